"""Prometheus metrics of the frontend, served at /metrics.

Request counters and latency histograms are updated as requests end; the gauges
(requests running and waiting, and every node's figures from its last heartbeat)
are read at scrape time, so a forgotten node leaves no stale series behind.
Each frontend has a registry of its own: no process-wide state.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from common.wire.figures import BUCKET_KEYS, WRITE_BUCKETS_S

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets in seconds, from a fast GPU step to a long CPU request.
_FAST = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
# Heartbeat figures exported per node: metric suffix -> (stats key, help).
NODE_FIGURES = {
    "kv_blocks_free": ("num_free_blocks", "KV blocks free"),
    "kv_blocks_usable": ("num_usable_blocks", "KV blocks in the cache"),
    "kv_blocks_reserved": ("num_reserved_blocks", "decode: KV blocks reserved for handoffs"),
    "batch_size": ("num_running", "decode: requests in the running batch"),
    "queue_len": ("num_queued", "decode: committed requests waiting for a batch row"),
    "waiting_prompts": ("num_waiting", "prefill: prompts waiting to be prefilled"),
    "waiting_prompt_tokens": ("num_waiting_tokens", "prefill: prompt tokens waiting"),
    "pending_handoffs": ("num_pending_handoffs", "prefill: KV handoffs not yet committed"),
    "prefix_cached_blocks": ("num_cached_blocks", "prefill: blocks held by the prefix cache"),
    "prefix_hit_rate": (
        "prefix_hit_rate",
        "prefill: share of prompt tokens taken from the prefix cache",
    ),
    "prefix_evictions": (
        "num_prefix_evictions",
        "prefill: prefix-cache blocks evicted (a running count)",
    ),
    "preemptions": (
        "num_preemptions",
        "decode: requests preempted for KV blocks (a running count)",
    ),
    "preempted": ("num_preempted", "decode: preempted requests waiting to resume"),
    "swapped_bytes": ("swapped_bytes", "decode: host memory holding preempted requests' KV"),
    "local_prefills": ("num_local_prefilled", "decode: prompts prefilled on it (a running count)"),
    "local_waiting": ("num_local_waiting", "decode: prompts waiting to be prefilled on it"),
}


class Metrics:
    def __init__(self, frontend):
        self.frontend = frontend
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.finished_total = Counter(
            "pdserve_requests_finished", "requests finished, by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "tokens generated for finished requests", registry=r
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_SLOW,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "after the first token, seconds per further token",
            buckets=_FAST,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "arrival to the last token",
            buckets=_SLOW,
            registry=r,
        )
        self.kv_transfer = Histogram(
            "pdserve_kv_transfer_seconds",
            "KV handoff, prefill done to commit on the decode node",
            buckets=_FAST,
            registry=r,
        )
        r.register(self)  # the gauges, via collect()
        # process_cpu_seconds_total, resident memory, open fds: the frontend's own cost.
        ProcessCollector(registry=r)

    def finished(self, req, reason: str) -> None:
        now = time.monotonic()
        self.finished_total.labels(reason).inc()
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.generation_tokens.inc(req.num_tokens)
        self.e2e.observe(now - req.submitted_at)
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.submitted_at)
            if req.num_tokens > 1:
                self.tpot.observe((now - req.first_token_at) / (req.num_tokens - 1))
        kv_ms = req.timings.get("kv_transfer_ms")
        if isinstance(kv_ms, (int, float)):
            self.kv_transfer.observe(kv_ms / 1e3)

    def describe(self):
        return []  # the gauges' names vary with the nodes: collected, not described

    def collect(self):
        fe = self.frontend
        num_waiting = fe.admission.num_waiting
        yield GaugeMetricFamily(
            "pdserve_requests_running",
            "requests sent to the nodes, not finished",
            value=len(fe.requests) - num_waiting,
        )
        yield GaugeMetricFamily(
            "pdserve_requests_waiting", "requests waiting at the frontend", value=num_waiting
        )
        alive = GaugeMetricFamily(
            "pdserve_node_is_alive", "1 while the node is live", labels=["node", "role"]
        )
        families = {
            k: GaugeMetricFamily(f"pdserve_node_{k}", h, labels=["node", "role"])
            for k, (_, h) in NODE_FIGURES.items()
        }
        for name, node in list(fe.nodes.items()):
            labels = [name, node.role]
            alive.add_metric(labels, float(node.is_alive))
            for k, (key, _) in NODE_FIGURES.items():
                value = node.stats.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    families[k].add_metric(labels, value)
        yield alive
        yield from families.values()
        yield from _transfer_families(fe.nodes)
        yield from _spec_decode_families(fe.nodes)
        moved = CounterMetricFamily(
            "pdserve_migrations",
            "requests moved to other nodes, by cause "
            "(a node dead, hung, restarted, a cut handoff, a drain)",
            labels=["cause"],
        )
        for cause, n in fe.migrations.num_moved.items():
            moved.add_metric([cause], n)
        yield moved
        paths = CounterMetricFamily(
            "pdserve_paths",
            "requests routed by path (local: prefilled on the decode "
            "node) and why (--disaggregate)",
            labels=["path", "why"],
        )
        for key, n in fe.paths.counts.items():
            paths.add_metric(key.split(": ", 1), n)
        yield paths
        yield CounterMetricFamily(
            "pdserve_migration_failures",
            "requests that could not move: over "
            "--max-migrations, or no node pair within --migration-wait",
            value=fe.migrations.num_failed,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _transfer_families(nodes: dict):
    """Per prefill node and KV transfer backend: transfers, bytes, failures and the write
    time, from its heartbeat's kv_writes (a figure that does not parse is left out)."""
    labels = ["node", "backend"]
    transfers = CounterMetricFamily("pdserve_kv_transfers", "KV writes completed", labels=labels)
    nbytes = CounterMetricFamily(
        "pdserve_kv_transfer_bytes", "bytes in completed KV writes", labels=labels
    )
    failed = CounterMetricFamily(
        "pdserve_kv_transfer_failures",
        "KV writes refused at the start or cut by a decode node's restart",
        labels=labels,
    )
    seconds = HistogramMetricFamily(
        "pdserve_kv_write_seconds", "a KV write's start to its completion", labels=labels
    )
    layerwise = CounterMetricFamily(
        "pdserve_kv_layerwise_transfers",
        "KV writes pushed layer by layer during their prefill",
        labels=labels,
    )
    chunked = CounterMetricFamily(
        "pdserve_kv_chunked_transfers",
        "of those, pushed over the passes of a chunked prompt",
        labels=labels,
    )
    rate = GaugeMetricFamily(
        "pdserve_kv_write_rate_bytes_per_second",
        "whole writes' rate, start to acknowledgement (a moving average; 0: none yet)",
        labels=labels,
    )
    for name, node in list(nodes.items()):
        writes = node.stats.get("kv_writes")
        for backend, f in writes.items() if isinstance(writes, dict) else ():
            counts = [f.get(k) for k in BUCKET_KEYS] if isinstance(f, dict) else []
            if not (
                isinstance(backend, str)
                and counts
                and all(map(_count, counts))
                and all(_count(f.get(k)) for k in ("num_transfers", "num_bytes", "num_failed"))
                and isinstance(f.get("write_s_sum"), (int, float))
            ):
                continue
            row = [name, backend]
            transfers.add_metric(row, f["num_transfers"])
            nbytes.add_metric(row, f["num_bytes"])
            failed.add_metric(row, f["num_failed"])
            cumulative, total = [], 0
            for bound, n in zip((*map(str, WRITE_BUCKETS_S), "+Inf"), counts):
                total += n
                cumulative.append((bound, total))
            seconds.add_metric(row, cumulative, float(f["write_s_sum"]))
            if _count(f.get("num_layerwise")):
                layerwise.add_metric(row, f["num_layerwise"])
            if _count(f.get("num_chunked")):
                chunked.add_metric(row, f["num_chunked"])
            if _count(f.get("bytes_per_s")):
                rate.add_metric(row, f["bytes_per_s"])
    yield from (transfers, nbytes, failed, seconds, layerwise, chunked, rate)


# Speculative decoding's running counts per decode node, under vLLM's spec_decode names.
SPEC_DECODE_COUNTS = {
    "num_drafts": ("num_drafts", "rows verified with one draft or more, over verify steps"),
    "num_draft_tokens": ("num_drafted_tokens", "draft tokens verified"),
    "num_accepted_tokens": ("num_accepted_tokens", "draft tokens accepted"),
}


def _spec_decode_families(nodes: dict):
    """Drafts, draft tokens and accepted tokens per decode node that speculates, and the
    accepted ones by their place in the draft (a figure that does not parse is left out)."""
    counts = {
        k: CounterMetricFamily(f"pdserve_spec_decode_{k}", h, labels=["node"])
        for k, (_, h) in SPEC_DECODE_COUNTS.items()
    }
    per_pos = CounterMetricFamily(
        "pdserve_spec_decode_num_accepted_tokens_per_pos",
        "draft tokens accepted, by their place in the draft (from 0)",
        labels=["node", "position"],
    )
    for name, node in list(nodes.items()):
        figures = [node.stats.get(key) for key, _ in SPEC_DECODE_COUNTS.values()]
        if not all(map(_count, figures)):
            continue
        for family, value in zip(counts.values(), figures):
            family.add_metric([name], value)
        by_pos = node.stats.get("num_accepted_per_pos")
        if isinstance(by_pos, list) and len(by_pos) <= 64 and all(map(_count, by_pos)):
            for pos, value in enumerate(by_pos):
                per_pos.add_metric([name, str(pos)], value)
    yield from (*counts.values(), per_pos)
