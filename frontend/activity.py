"""The frontend's periodic log line, as vLLM's: requests finished per second, requests
running and waiting, the prompt and generation tokens/s the nodes computed, the decode
nodes' KV cache usage and the prefill nodes' prefix-cache hit rate. Said every
interval while the cluster works, once more as it becomes idle, and not while it stays
idle (common/base/log.py: IdleQuiet)."""

from __future__ import annotations

import asyncio
import time

from common.base.log import IdleQuiet, get_logger

log = get_logger("frontend")
# What the line sums over the nodes, from their heartbeats: name -> (role, stats keys
# summed). NOTE: a decode step makes a token a row and, in a verify step, one more for
# each accepted draft (speculative decoding): rows alone undercount.
COUNTS = {
    "prompt": ("prefill", ("num_prefill_tokens",)),
    "generated": ("decode", ("num_decode_rows", "num_accepted_tokens")),
    "hits": ("prefill", ("num_prefix_hit_tokens",)),
    "queried": ("prefill", ("num_prefix_prompt_tokens",)),
}


def _number(stats: dict, key: str) -> int:
    """A figure from a node's heartbeat; anything but a count reads as 0."""
    value = stats.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class ActivityLog:
    """fe: the Frontend (its nodes, requests, admission and num_served)."""

    def __init__(self, fe, interval_s: float):
        self.fe, self.interval_s = fe, interval_s
        self.quiet = IdleQuiet()
        self.last_at: float | None = None
        self.num_served = 0
        self.seen: dict[tuple[str, str], tuple[int, int]] = {}  # (node, key) -> (pid, value)

    def _deltas(self) -> dict[str, int]:
        """Each count's growth since the last look, summed over the live nodes (a node
        that restarted counts from its own start)."""
        out = dict.fromkeys(COUNTS, 0)
        for node in list(self.fe.nodes.values()):
            if not node.is_alive:
                continue
            for name, (role, keys) in COUNTS.items():
                if node.role != role:
                    continue
                for key in keys:
                    # NOTE: each key apart, and a key absent from a heartbeat left as it was:
                    # summed first, one that comes and goes read as a restart each time
                    if key not in node.stats:
                        continue
                    value = _number(node.stats, key)
                    pid, last = self.seen.get((node.name, key), (node.ready.pid, 0))
                    is_same = pid == node.ready.pid and value >= last
                    out[name] += value - last if is_same else value
                    self.seen[(node.name, key)] = (node.ready.pid, value)
        return out

    def _kv_usage(self) -> float | None:
        """The share of the live decode nodes' KV blocks in use or promised."""
        usable = used = 0
        for node in list(self.fe.nodes.values()):
            if node.is_alive and node.role == "decode":
                total = _number(node.stats, "num_usable_blocks")
                usable += total
                used += max(total - _number(node.stats, "num_available_blocks"), 0)
        return used / usable if usable else None

    async def run(self) -> None:
        """The frontend's task: the line every interval, for as long as it serves. A fault
        here is logged, never the end of the frontend."""
        while True:
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - a log line must not stop the service
                log.exception("could not write the periodic line")
            await asyncio.sleep(self.interval_s)

    def tick(self, now: float) -> None:
        """The watchdog's tick: the line, once an interval has passed."""
        if self.last_at is None:
            self.last_at = now
            self.num_served = self.fe.num_served
            self._deltas()
            return
        elapsed = now - self.last_at
        if elapsed < self.interval_s:
            return
        d = self._deltas()
        served = self.fe.num_served - self.num_served
        self.num_served = self.fe.num_served
        self.last_at = now
        num_waiting = self.fe.admission.num_waiting
        num_running = len(self.fe.requests) - num_waiting
        is_busy = bool(served or num_running or num_waiting or d["prompt"] or d["generated"])
        if not self.quiet.says(is_busy):
            return
        usage = self._kv_usage()
        log.info(
            "%.2f req/s | running %d, waiting %d | prompt %.0f tok/s, generation %.0f tok/s | "
            "KV cache %s used | prefix-cache hit rate %s%s",
            served / elapsed,
            num_running,
            num_waiting,
            d["prompt"] / elapsed,
            d["generated"] / elapsed,
            "-" if usage is None else f"{usage:.1%}",
            f"{d['hits'] / d['queried']:.1%}" if d["queried"] else "-",
            "" if is_busy else " | idle now",
        )
