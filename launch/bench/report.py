"""What one rate of pdserve bench reports: the latency distributions, goodput, the
cluster's own figures over the run, and the plot of a sweep."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from launch.bench.table import cell, table


@dataclass
class Outcome:
    """One request of the benchmark, as its client saw it."""

    input_len: int
    sent_at: float
    chunk_at: list[float] = field(default_factory=list)  # arrival of each output carrying tokens
    num_tokens: int = 0
    ended_at: float = 0.0
    error: str | None = None
    parts: dict = field(default_factory=dict)
    interface: str = "zmq"

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_at[0] - self.sent_at if self.chunk_at else None

    @property
    def tpot_s(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.chunk_at[-1] - self.chunk_at[0]) / (self.num_tokens - 1)


PARTS = (
    "queue_ms",
    "prefill_ms",
    "kv_transfer_ms",
    "kv_write_ms",
    "kv_commit_ms",
    "decode_admission_ms",
)


def _dist(values_s: list[float]) -> dict:
    """mean / median / p90 / p99 in milliseconds."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    v = sorted(x * 1e3 for x in values_s)

    def pct(p: float) -> float:
        return round(v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))], 3)

    return {
        "mean": round(statistics.fmean(v), 3),
        "median": pct(50),
        "p90": pct(90),
        "p99": pct(99),
    }


def summarize(outcomes: list[Outcome], duration_s: float, rate: float, slo: dict) -> dict:
    ok = [o for o in outcomes if o.error is None]
    num_out = sum(o.num_tokens for o in ok)
    num_in = sum(o.input_len for o in ok)
    itl = [b - a for o in ok for a, b in zip(o.chunk_at, o.chunk_at[1:])]

    def meets(o: Outcome) -> bool:
        return (
            o.ttft_s is not None
            and o.ttft_s * 1e3 <= slo.get("ttft_ms", float("inf"))
            and (o.tpot_s is None or o.tpot_s * 1e3 <= slo.get("tpot_ms", float("inf")))
            and (o.ended_at - o.sent_at) * 1e3 <= slo.get("e2e_ms", float("inf"))
        )

    parts = {
        p: round(statistics.median(vals), 3)
        if (vals := [o.parts[p] for o in ok if p in o.parts])
        else None
        for p in PARTS
    }
    errors = sorted({o.error for o in outcomes if o.error})
    return {
        "request_rate": "inf" if rate == float("inf") else rate,
        "num_requests": len(outcomes),
        "completed": len(ok),
        "errors": len(outcomes) - len(ok),
        "error_kinds": errors[:5],
        "duration_s": round(duration_s, 4),
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "request_throughput": round(len(ok) / duration_s, 3),
        "output_tokens_per_s": round(num_out / duration_s, 1),
        "total_tokens_per_s": round((num_in + num_out) / duration_s, 1),
        "goodput": round(sum(meets(o) for o in ok) / duration_s, 3) if slo else None,
        "slo": slo or None,
        "ttft_ms": _dist([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_ms": _dist([o.tpot_s for o in ok if o.tpot_s is not None]),
        "itl_ms": _dist(itl),
        "e2e_ms": _dist([o.ended_at - o.sent_at for o in ok]),
        "cluster_ttft_parts_median_ms": parts,
    }


def cluster_record(before: dict, after: dict, outcomes: list[Outcome]) -> dict:
    """What the cluster did over one rate: prompt tokens computed per request (prefix
    caching shows here), the mean prefill and decode batches and the preemptions (over
    ZeroMQ), and the frontend's CPU time per token it streamed (all it did meanwhile)."""
    d = {k: after[k] - before[k] for k in before if k != "frontend_cpu_s"}
    num_tokens = sum(o.num_tokens for o in outcomes)
    cpu_s = (
        None
        if None in (before["frontend_cpu_s"], after["frontend_cpu_s"])
        else after["frontend_cpu_s"] - before["frontend_cpu_s"]
    )
    record = {
        "frontend_cpu_us_per_token": round(cpu_s / num_tokens * 1e6, 1)
        if cpu_s is not None and num_tokens
        else None
    }
    if not d:  # over HTTP
        return {"prefill_tokens_per_request": None, **record}
    return {
        "prefill_tokens_per_request": round(d["num_prefill_tokens"] / max(len(outcomes), 1), 1),
        **record,
        "mean_prefill_batch": round(d["num_prefill_chunks"] / d["num_prefill_passes"], 2)
        if d["num_prefill_passes"]
        else None,
        "mean_decode_batch": round(d["num_decode_rows"] / d["num_decode_steps"], 2)
        if d["num_decode_steps"]
        else None,
        "num_preemptions": d["num_preemptions"],
    }


def samples(outcomes: list[Outcome]) -> dict:
    """Each completed request's TTFT and TPOT (ms): what the distributions are drawn from."""
    ok = [o for o in outcomes if o.error is None]
    return {
        "ttft_ms": [round(o.ttft_s * 1e3, 3) for o in ok if o.ttft_s is not None],
        "tpot_ms": [round(o.tpot_s * 1e3, 3) for o in ok if o.tpot_s is not None],
    }


def table_of(records: list[dict]) -> str:
    """Every rate of a sweep, one row each, as vLLM's and SGLang's benchmarks sum a run up."""
    rows = []
    for r in records:
        ttft, tpot, itl, e2e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2e_ms"]
        rows.append(
            [
                str(r["request_rate"]),
                f"{r['completed']}/{r['num_requests']}",
                str(r["errors"]),
                cell(r["request_throughput"], 2),
                cell(r["output_tokens_per_s"]),
                cell(r["goodput"], 2),
                cell(ttft["median"]),
                cell(ttft["p99"]),
                cell(tpot["median"], 2),
                cell(tpot["p99"], 2),
                cell(itl["median"], 2),
                cell(e2e["median"]),
            ]
        )
    first = records[0]
    notes = [
        f"goodput: requests/s meeting {first['slo']}"
        if first.get("slo")
        else "goodput: give --slo ttft_ms=...,tpot_ms=... to count the requests that meet it"
    ]
    return table(
        f"serving: {first['model']} over {first['interface']} ({first['target']}), input "
        f"{first['input_len']}, output {first['output_len']}; latencies in ms",
        [
            "rate",
            "done",
            "errors",
            "req/s",
            "out tok/s",
            "goodput",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
            "ITL p50",
            "E2E p50",
        ],
        rows,
        notes,
    )


def plot(path: str, records: list[dict]) -> None:
    """Latency percentiles against achieved throughput across the sweep (the knee), on a
    log axis with each point labelled by the rate offered (a burst's rate is what it
    achieved), and the TTFT and TPOT distributions at each rate. records: as --save-json
    writes them, each with its "samples"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    x = [r["request_throughput"] for r in records]
    for ax, key, title in ((axes[0][0], "ttft_ms", "TTFT"), (axes[0][1], "tpot_ms", "TPOT")):
        for stat, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [r[key][stat] for r in records], style, label=stat)
        for r, at in zip(records, x):  # each point: the rate it was offered
            if r[key]["median"] is not None and at > 0:
                label = "all at once" if r["request_rate"] == "inf" else f"{r['request_rate']:g}/s"
                ax.annotate(
                    label,
                    (at, r[key]["median"]),
                    textcoords="offset points",
                    xytext=(4, 6),
                    fontsize=8,
                )
        ax.set_xscale("log")
        ax.set(
            xlabel="achieved requests/s (log)",
            ylabel=f"{title} (ms)",
            title=f"{title} against throughput",
        )
        ax.grid(alpha=0.3)
        ax.legend()
    for ax, key, title in ((axes[1][0], "ttft_ms", "TTFT"), (axes[1][1], "tpot_ms", "TPOT")):
        for record in records:
            values = sorted(record["samples"][key])
            if values:
                ax.plot(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    label=f"rate {record['request_rate']}",
                )
        ax.set(
            xlabel=f"{title} (ms)",
            ylabel="fraction of requests",
            title=f"{title} distribution (CDF)",
        )
        ax.grid(alpha=0.3)
        ax.legend()
    first = records[0]
    fig.suptitle(
        f"pdserve bench: {first['model']} over {first['interface']}, input {first['input_len']}, "
        f"output {first['output_len']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
