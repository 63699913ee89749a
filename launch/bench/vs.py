"""pdserve against vLLM on the same machine, model and client: each server is
started alone, the same `pdserve bench` workloads go to its OpenAI API, it is
stopped, then the other; --runs repeats the pair. One table with the ratios,
and one JSON line with every figure.

    bash launch/bench_vs.sh [--model DIR] [--runs 3] [--vllm-python PATH] [--workloads sat430,...]

--against DIR runs another pdserve checkout in vLLM's place (say `git worktree add
DIR COMMIT`): this tree and that one started alternately, so a change is measured
against this machine's run-to-run spread. It runs on this environment's packages.

With no --model, a random Qwen3 of --shape is made on first use: `tiny` (hidden 128,
4 heads of 32, 2 KV heads: a shape both servers' CPU attention takes) or `qwen3-0.6b`
(28 layers, hidden 1024, 16/8 heads of 128, vocabulary 151,936, tied), in --dtype. vLLM is run only
where --vllm-python (or $VLLM_PYTHON) names an interpreter that imports it; see
docs/BENCHMARKS.md for installing its CPU build beside pdserve (never into it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common.runtime.process import HelpFormat
from launch.bench.servers import start_pdserve, start_vllm

ROOT = Path(__file__).resolve().parents[2]
SERVER_ARGS = ["--max-model-len", "2048"]  # and --dtype, --max-num-seqs: flags here
# name: (bench flags, what the table shows for it)
WORKLOADS = {
    "sat430": (
        [
            "--input-len",
            "430",
            "--output-len",
            "64",
            "--num-prompts",
            "128",
            "--request-rate",
            "inf",
        ],
        "~430 in / 64 out, 128 at once",
    ),
    "sat1000": (
        [
            "--input-len",
            "1000",
            "--output-len",
            "32",
            "--num-prompts",
            "128",
            "--request-rate",
            "inf",
        ],
        "~1,000 in / 32 out, 128 at once",
    ),
    "rate4": (
        ["--input-len", "430", "--output-len", "64", "--num-prompts", "48", "--request-rate", "4"],
        "~430 in / 64 out at 4 req/s",
    ),
    # A model of real size on a CPU: prompts of 128, 32 out (Qwen3-0.6B's shape).
    "sat128": (
        [
            "--input-len",
            "128",
            "--output-len",
            "32",
            "--num-prompts",
            "32",
            "--request-rate",
            "inf",
        ],
        "~128 in / 32 out, 32 at once",
    ),
    "light128": (
        [
            "--input-len",
            "128",
            "--output-len",
            "32",
            "--num-prompts",
            "12",
            "--request-rate",
            "0.5",
        ],
        "~128 in / 32 out at 0.5 req/s",
    ),
}
SHAPES = {  # make_tiny_model flags
    "tiny": [
        "--hidden-size",
        "128",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "32",
        "--intermediate-size",
        "256",
        "--max-position-embeddings",
        "4096",
    ],
    "qwen3-0.6b": [
        "--layers",
        "28",
        "--hidden-size",
        "1024",
        "--intermediate-size",
        "3072",
        "--heads",
        "16",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--vocab-size",
        "151936",
        "--tie-embeddings",
        "--max-position-embeddings",
        "4096",
    ],
}


def log(msg: str) -> None:
    print(f"[bench_vs] {msg}", file=sys.stderr, flush=True)


def run_workload(url: str, flags: list[str], vocab_size: int, seed: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "launch.bench.serving",
        "--base-url",
        url,
        "--quiet",
        "--vocab-size",
        str(vocab_size),
        "--seed",
        str(seed),
        "--ignore-eos",
        *flags,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(
            f"bench_vs: the benchmark printed no figures (exit {p.returncode}):\n{p.stderr[-2000:]}"
        )
    return json.loads(lines[-1])


def figures(r: dict) -> dict:
    return {
        "request_throughput": r["request_throughput"],
        "errors": r["errors"],
        "completed": r["completed"],
        "ttft_p50_ms": r["ttft_ms"]["median"],
        "ttft_p99_ms": r["ttft_ms"]["p99"],
        "tpot_p50_ms": r["tpot_ms"]["median"],
        "output_tokens_per_s": r["output_tokens_per_s"],
    }


def spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.1f}" if len(values) == 1 else f"{med:.1f} ({min(values):.1f}–{max(values):.1f})"


def table(results: dict, servers: list[str], workloads: list[str]) -> str:
    rows = [
        (
            "workload",
            "figure",
            *servers,
            *([f"{servers[0]}/{servers[1]}"] if len(servers) == 2 else []),
        )
    ]
    for w in workloads:
        shown = (
            ["request_throughput", "ttft_p50_ms", "tpot_p50_ms"]
            if w.startswith("sat")
            else ["ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms"]
        )
        for fig in shown:
            vals = {s: [run[fig] for run in results[s][w]] for s in servers}
            row = [WORKLOADS[w][1], fig, *(spread(vals[s]) for s in servers)]
            if len(servers) == 2:
                a, b = (statistics.median(vals[s]) for s in servers)
                row.append(f"{a / b:.2f}x" if b else "-")
            rows.append(tuple(row))
        errs = {s: sum(run["errors"] for run in results[s][w]) for s in servers}
        rows.append(
            (
                WORKLOADS[w][1],
                "failed requests",
                *(str(errs[s]) for s in servers),
                *([""] if len(servers) == 2 else []),
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve bench vs", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument(
        "--model", default=None, help="a Qwen3 model directory (default: one of --shape made here)"
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="the random model made without --model",
    )
    p.add_argument("--dtype", default="float32", help="both servers' --dtype (float32 or bfloat16)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="both servers' batch bound")
    p.add_argument("--runs", type=int, default=3, help="each server this many times, alternating")
    p.add_argument(
        "--workloads",
        default=None,
        help=f"a comma list of {', '.join(WORKLOADS)} (default: sat430,sat1000,rate4 for "
        f"the tiny shape, sat128,light128 for a real one)",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON"),
        help="an interpreter whose environment has vLLM (default: $VLLM_PYTHON); "
        "without it only pdserve runs",
    )
    p.add_argument(
        "--against",
        default=None,
        metavar="DIR",
        help="another pdserve checkout, run in vLLM's place, alternately with this one",
    )
    p.add_argument("--port", type=int, default=8300, help="each server's HTTP port in turn")
    p.add_argument("--base-port", type=int, default=5900, help="pdserve's ZeroMQ base port")
    p.add_argument(
        "--pdserve-arg", action="append", default=[], help="one more start_cluster.sh flag"
    )
    p.add_argument(
        "--against-arg",
        action="append",
        default=[],
        help="one more start_cluster.sh flag for --against's checkout alone (a checkout against "
        "itself with a flag: --against DIR --against-arg=--speculative-config ...)",
    )
    p.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM server flag")
    p.add_argument("--logs", default=None, help="server logs go here (default: a temporary folder)")
    p.add_argument("--save-json", default=None, help="also append the JSON line to this file")
    p.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds each server gets to start"
    )
    a = p.parse_args(argv)
    a.workloads = a.workloads or (
        "sat430,sat1000,rate4" if a.shape == "tiny" and not a.model else "sat128,light128"
    )
    workloads = [w for w in a.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if a.against_arg and not a.against:
        p.error("--against-arg needs --against")
    if unknown or not workloads or a.runs < 1:
        p.error(f"--workloads takes {', '.join(WORKLOADS)}; --runs >= 1")
    servers = ["pdserve"]
    starters = {"pdserve": start_pdserve, "vllm": start_vllm}
    if a.against:
        other = Path(a.against).resolve()
        if not (other / "launch" / "start_cluster.sh").is_file():
            p.error(f"--against {a.against} is not a pdserve checkout")
        name = f"pdserve@{other.name}"
        starters[name] = lambda a, model, logs: start_pdserve(a, model, logs, other, name)
        servers.append(name)
    elif a.vllm_python:
        check = subprocess.run([a.vllm_python, "-c", "import vllm"], capture_output=True, text=True)
        if check.returncode != 0:
            p.error(f"{a.vllm_python} cannot import vllm: {check.stderr.strip().splitlines()[-1:]}")
        servers.append("vllm")
    else:
        log("no --vllm-python (or $VLLM_PYTHON) and no --against: measuring pdserve alone")
    a.server_args = [*SERVER_ARGS, "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs)]
    model = a.model
    if model is None:
        home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
        model = str(home / ("tiny-qwen3-vs" if a.shape == "tiny" else f"vs-{a.shape}-{a.dtype}"))
        if not (Path(model) / "config.json").is_file():
            log(f"making a random Qwen3 of shape {a.shape} at {model}")
            dtype = [] if a.shape == "tiny" else ["--dtype", a.dtype]
            subprocess.run(
                [sys.executable, "-m", "launch.make_tiny_model", model, *SHAPES[a.shape], *dtype],
                check=True,
                stdout=subprocess.DEVNULL,
                cwd=ROOT,
            )
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    import tempfile

    logs = Path(a.logs or tempfile.mkdtemp(prefix="bench_vs-"))
    logs.mkdir(parents=True, exist_ok=True)
    results = {s: {w: [] for w in workloads} for s in servers}
    for run in range(a.runs):
        for name in servers:
            log(f"run {run + 1}/{a.runs}: starting {name}")
            server = starters[name](a, model, logs)
            try:
                server.wait_ready(a.ready_timeout)
                for i, w in enumerate(workloads):
                    # NOTE: prompts of their own per workload: with one seed the next workload's
                    # prompts would be the last one's, served from the prefix cache.
                    r = figures(
                        run_workload(server.url, WORKLOADS[w][0], vocab, seed=run * 100 + i)
                    )
                    results[name][w].append(r)
                    log(
                        f"  {name} {w}: {r['request_throughput']:.1f} req/s, TTFT p50 "
                        f"{r['ttft_p50_ms']:.1f} ms, TPOT p50 {r['tpot_p50_ms']:.1f} ms, "
                        f"{r['errors']} failed"
                    )
            finally:
                server.stop()
    from launch.bench.common import device_name

    print(table(results, servers, workloads), file=sys.stderr)
    record = {
        "bench": "vs",
        "device": device_name("cpu"),
        "model": model,
        "runs": a.runs,
        "server_args": a.server_args,
        "pdserve_args": a.pdserve_arg,
        "results": results,
        "bound": servers[1] if len(servers) == 2 else None,
    }
    if len(servers) == 2:

        def ratio(w: str, fig: str) -> float:
            return statistics.median(r[fig] for r in results[servers[0]][w]) / statistics.median(
                r[fig] for r in results[servers[1]][w]
            )

        record["ratios"] = {
            w: {fig: ratio(w, fig) for fig in ("request_throughput", "ttft_p50_ms", "tpot_p50_ms")}
            for w in workloads
        }
    line = json.dumps(record)
    print(line, flush=True)
    if a.save_json:
        with open(a.save_json, "a") as f:
            f.write(line + "\n")
    return 1 if any(r["errors"] for s in servers for w in workloads for r in results[s][w]) else 0


if __name__ == "__main__":
    sys.exit(main())
