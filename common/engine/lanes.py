"""CPU prefill lanes: a pass's prompt chunks split over threads, each running whole
forwards on one torch thread. No barrier per op waits for a core another process
holds, and a busy host just time-slices the lanes, which run at a lower priority than the
node's own loop: prefill throughput takes the cores the latency-bound work (decode steps, the
frontend) leaves, not a share fixed in advance. NOTE: where the kernel groups processes by
session (autogroup), that priority ranks the lanes within their node only; against the
other nodes (each a session of its own) the core table keeps the turns
(docs/bench/2026-11-28-cpu-one-session.md). One long prompt runs as one pass on every
lane's thread, or as runs of its tokens, a lane each, each a layer behind the one before
(forward_pipelined: the lanes meet once a layer instead of at every op's end, which a host
whose cores others take favours): whichever has been faster here."""

from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, TypeVar

import torch

from common.base.log import get_logger
from common.base.threads import lower_this_thread

T = TypeVar("T")
log = get_logger("lanes")
LANE_NICE = 10
# A pass kept in one piece (a chunk with prompt logprobs) shorter than this per thread runs on one
# lane: an op split over threads waits at its end for every one of them, and on a shared
# host one may have no core.
MIN_TOKENS_PER_THREAD = 1024
# A lone chunk of this many tokens a lane or more runs on every lane (_forward_lone): as one
# pass, or cut into runs a layer apart (the lanes meet once a layer, but each streams every
# weight, which a short run's time is mostly). A shorter one runs as one pass on every
# lane's thread where it is worth them (worth: pass_size.threads_worth; Qwen3-0.6B's 128
# tokens on two idle cores, in process: 300 ms on one lane, 205-215 as one pass), else on
# one lane (a tiny model's: an op split over threads then waits at its end for all of them).
# NOTE: never cut: a run of no tokens would be a pass of none.
MIN_TOKENS_PER_PART = 256
# A lone chunk runs as runs a layer apart (forward_pipelined) or as one pass on every lane's
# thread, whichever its node's recent lone chunks took less time for their work with: at the 0.6B
# shape's 1,024 tokens the pass is 12% faster on two idle cores, 10% slower beside a process
# busy on one of them. Every EXPLORE_EVERY-th lone chunk runs the other way, so a host that
# changes is seen (odd: a prompt cut into two chunks is not explored on its second alone).
EXPLORE_EVERY = 7
FEED_S = 0.005  # on_layers is called at least this often during a pass


def _start_lane() -> None:
    torch.set_num_threads(1)
    lower_this_thread(LANE_NICE)


def run_on_own_thread(fn: Callable[[], T], what: str = "pass") -> T:
    """fn() on a new thread (it inherits this one's priority; named after this one and
    `what`), waited for; its result or its error here. An interrupt while waiting is raised
    once fn has ended; a second while it still runs is raised at once (fn left running)."""
    got: list = []
    began, ended = threading.Event(), threading.Event()

    def target() -> None:
        began.set()
        try:
            got.append((fn(), None))
        except BaseException as e:  # NOTE: raised again on the caller's thread
            got.append((None, e))
        finally:
            ended.set()

    name = f"{threading.current_thread().name}-{what}"
    thread = threading.Thread(target=target, name=name, daemon=True)
    is_started = False
    try:
        try:
            thread.start()
        except RuntimeError:  # NOTE: no thread to be had: nothing runs, nothing to wait for
            ended.set()
            raise
        is_started = True
        ended.wait()
    except BaseException:
        # NOTE: interrupted inside start() before the thread existed, it never begins
        if not ended.is_set() and (is_started or began.wait(1.0)):
            # NOTE: an interrupt (Ctrl-C where Python's own handler stands) is raised once fn
            # has ended, never beside the caller's next steps; a second one abandons it (the
            # process may then abort at exit, torch's threads still running). Not join(): on
            # Python 3.11 one interrupted marks the thread ended while it runs.
            log.warning("interrupted: waiting for %s to end (again to abandon it)", name)
            ended.wait()
        got.clear()  # NOTE: fn's result or error goes with the interrupt, and no cycle with it
        raise
    thread.join()  # NOTE: at once: fn has returned
    out, error = got.pop()
    if error is None:
        return out
    try:
        raise error
    finally:
        del error  # NOTE: its traceback holds this frame: no cycle keeps the pass's tensors


class Lanes:
    """forward(chunks) -> the hidden state of each chunk's last token [len(chunks), H].

    on_layers(chunk_indices, num_done), where given, is called on the caller's thread (the
    node's loop, which owns the sockets) while the lanes run: those chunks' first num_done
    layers' KV is written (as each layer's attention starts); and every FEED_S with no chunk
    indices, so KV held back for a link that was full goes out as it drains. The caller
    waits in that loop: nothing else runs there."""

    def __init__(
        self,
        num_lanes: int,
        forward: Callable[..., torch.Tensor],
        pair_cost: float = 0.0,
        worth: Callable[[int], int] = lambda num_tokens: 1,
    ):
        self.num_lanes = num_lanes
        self.worth = worth  # threads a lone chunk of num_tokens is worth
        self._forward = (
            forward  # forward(chunks, between_layers=None, kv_written=None): qwen3.forward's hooks
        )
        self.pair_cost = pair_cost  # attention per (query, key) pair over a token's matmuls
        self._pair_cost_0 = pair_cost
        # a lone long chunk: parts a layer apart (True), one pass on every lane's thread
        # (False), or whichever took less time for its work (None)
        self.is_pipelined: bool | None = None
        # pipelined or not -> seconds a unit of work (a token's matmuls, its attention pairs
        # at pair_cost each: split_tokens' measure), smoothed
        self.token_s: dict[bool, float] = {}
        self.num_lone = 0
        self._pool = ThreadPoolExecutor(
            num_lanes, thread_name_prefix="prefill-lane", initializer=_start_lane
        )

    def close(self) -> None:
        self._pool.shutdown()

    def _on_lane(
        self, chunks: list, num_threads: int, between_layers, kv_written, may_grow: bool = False
    ) -> torch.Tensor:
        """The forward on this lane's thread, or, on more than one thread (or one that
        between_layers may give more: may_grow), on a thread that ends with the pass.
        NOTE: an OpenMP pool lives as long as the thread that started it, and while more
        threads are pooled than the process has CPUs, libgomp puts every pool's idle threads
        to sleep at once instead of letting them spin: each parallel region of the decode
        steps (or of another lane's passes) then waits for a wake-up (two threads, Qwen3-0.6B's
        attention at batch 1: 26 against 90 us a layer)."""
        if num_threads == 1 and not may_grow:
            return self._forward_on(chunks, 1, between_layers, kv_written)
        return run_on_own_thread(
            lambda: self._forward_on(chunks, num_threads, between_layers, kv_written)
        )

    @torch.inference_mode()  # NOTE: thread-local: the thread that runs it must enter it itself
    def _forward_on(self, chunks: list, num_threads: int, between_layers, kv_written):
        torch.set_num_threads(num_threads)  # NOTE: per thread: its ops, and the pool it starts
        try:
            return self._forward(chunks, between_layers, kv_written)
        finally:
            torch.set_num_threads(1)

    def _part(
        self, chunks: list, idx: list[int], num_threads: int, between_layers, may_grow=False
    ) -> Callable:
        """A lane's task: the chunks idx as one forward; post(idx, n) as each layer's KV is
        written."""

        def task(post):
            kv_written = None if post is None else (lambda num_done: post(idx, num_done))
            part = [chunks[i] for i in idx]
            return self._on_lane(part, num_threads, between_layers, kv_written, may_grow)

        return task

    def _run(self, tasks: list[Callable], on_layers) -> list:
        """Each task(post) on a lane; post(idx, n) calls on_layers(idx, n) on this thread.
        Their results."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        post = None if on_layers is None else (lambda idx, n: inbox.put((idx, n)))
        futures = [self._pool.submit(task, post) for task in tasks]
        for future in futures:
            future.add_done_callback(lambda _: inbox.put(None))
        future = None  # NOTE: no name here may hold a future (see below)
        num_running, error = len(futures), None
        while num_running:  # NOTE: to the end even if on_layers fails: the lanes write the cache
            try:
                item = inbox.get(timeout=FEED_S) if on_layers is not None else inbox.get()
            except queue.Empty:
                item = (
                    [],
                    0,
                )  # no layer done: what waits to be sent may move (a link that takes more)
            if item is None:
                num_running -= 1
            elif error is None:
                try:
                    on_layers(*item)
                except Exception as e:
                    error = e
        failures = [e for e in (f.exception() for f in futures) if e is not None]
        error = error or (failures[0] if failures else None)
        results = None if error else [f.result() for f in futures]
        # NOTE: a future holds its error, whose traceback would hold this frame once raised
        # here: a cycle that kept a failed pass's tensors until the collector ran
        del futures, failures
        if error is not None:
            try:
                raise error
            finally:
                del error
        return results

    def forward_whole(
        self, chunks: list, num_threads: int, between_layers=None, on_layers=None
    ) -> torch.Tensor:
        """The chunks as one pass on num_threads threads, started from a lane: they keep its
        lower priority, so the latency-bound work on this host still comes first.
        between_layers(n), called on the lane, may resize the pool (torch.set_num_threads)."""
        every = list(range(len(chunks)))
        may_grow = between_layers is not None
        return self._run(
            [self._part(chunks, every, num_threads, between_layers, may_grow)], on_layers
        )[0]

    def _forward_lone(self, chunk, num_lanes: int, on_layers) -> torch.Tensor:
        """One long chunk, as runs a layer apart or as one pass on every lane's thread:
        whichever is_pipelined says, else whichever has taken less time for its work."""
        is_pipelined = self.is_pipelined
        if is_pipelined is None:
            self.num_lone += 1
            t = self.token_s
            if len(t) < 2:
                is_pipelined = False in t  # each way once, one pass first
            else:
                is_pipelined = t[True] < t[False]
                if self.num_lone % EXPLORE_EVERY == 0:
                    is_pipelined = not is_pipelined  # the other way now and then: hosts change
        # NOTE: by its work, not its tokens: a later chunk of a long prompt (more context)
        # costs more a token, and the two ways differ by ~10% only; at the pair cost before
        # the pass (a pipelined pass fits it anew)
        n, c = len(chunk.token_ids), chunk.context_len
        work = n + self.pair_cost * (c * n + n * n / 2)
        began = time.perf_counter()
        if is_pipelined:
            out = self.forward_pipelined(chunk, num_lanes, on_layers)
        else:
            out = self.forward_whole([chunk], num_lanes, None, on_layers)
        took = (time.perf_counter() - began) / work
        old = self.token_s.get(is_pipelined)
        self.token_s[is_pipelined] = took if old is None else (old + took) / 2
        return out

    def forward_pipelined(self, chunk, num_parts: int, on_layers=None) -> torch.Tensor:
        """One long chunk as num_parts runs of its tokens of about equal cost, a lane each, part
        j a layer behind part j - 1 (its attention reads that part's KV of the layer): the lanes
        meet once a layer, not at every op's end, so a thread the host takes away for a while
        (the network's, another process's) stalls only the parts behind it. -> [1, H].
        NOTE: worth it on a host whose cores are shared; the price is one layer of the first
        part's time before the last starts (1 / num_layers of the pass on two lanes)."""
        bounds = split_tokens(len(chunk.token_ids), chunk.context_len, num_parts, self.pair_cost)
        parts = [
            replace(chunk, token_ids=chunk.token_ids[a:b], context_len=chunk.context_len + a)
            for a, b in zip(bounds, bounds[1:])
        ]
        cond, num_done, cpu_s = threading.Condition(), [0] * len(parts), [0.0] * len(parts)

        def mark(j: int, n: float) -> None:
            with cond:
                num_done[j] = n
                cond.notify_all()

        def wait(j: int, n: int) -> None:
            with cond:
                cond.wait_for(lambda: num_done[j] >= n)

        def task(j: int) -> Callable:
            def run(post):
                def after(n: int) -> None:
                    mark(j, n)
                    if j:
                        wait(j - 1, n + 1)

                # The whole chunk's KV of a layer is written once the last part's is: the parts
                # before it are at least a layer ahead.
                kv_written = (
                    (lambda n: post([0], n)) if post is not None and j == len(parts) - 1 else None
                )
                try:
                    if j:
                        wait(j - 1, 1)
                    start = time.thread_time()  # NOTE: CPU time: not what waits or what others take
                    out = self._on_lane([parts[j]], 1, after, kv_written)
                    cpu_s[j] = time.thread_time() - start
                    return out
                finally:
                    mark(j, math.inf)  # NOTE: also on an error: no part waits forever

            return run

        last_hidden = self._run([task(j) for j in range(len(parts))], on_layers)[-1]
        self._fit_pair_cost([(len(p.token_ids), p.context_len) for p in parts], cpu_s)
        return last_hidden

    def _fit_pair_cost(self, parts: list[tuple[int, int]], cpu_s: list[float]) -> None:
        """pair_cost from the first and the last part's CPU times (a token's matmuls and its
        pairs' attention, t = k (x + p y)): the attention kernel's rate against the matmuls'
        is the host's own; moved half way to each pass's fit, within [1/2, 8] of the start."""
        (x0, c0), (x1, c1) = parts[0], parts[-1]
        y0, y1 = x0 * (c0 + x0 / 2), x1 * (c1 + x1 / 2)
        t0, t1 = cpu_s[0], cpu_s[-1]
        den = t0 * y1 - t1 * y0
        if t0 <= 0 or t1 <= 0 or den <= 0:
            return
        fit = (t1 * x0 - t0 * x1) / den
        if fit > 0:
            lo, hi = self._pair_cost_0 / 2, self._pair_cost_0 * 8
            self.pair_cost = min(max((self.pair_cost + fit) / 2, lo), hi)

    def split(self, chunks: list, num_lanes: int | None = None) -> list[list[int]]:
        """Chunk indices per lane (at most num_lanes, default all), balanced by tokens
        (largest first). NOTE: chunks that asked for prompt logprobs need all of their
        hidden states, which only a pass in one piece keeps."""
        num_lanes = min(num_lanes or self.num_lanes, len(chunks))
        if num_lanes < 2 or any(c.prompt_targets is not None for c in chunks):
            return [list(range(len(chunks)))]
        lanes: list[list[int]] = [[] for _ in range(num_lanes)]
        loads = [0] * num_lanes
        for i in sorted(range(len(chunks)), key=lambda i: -len(chunks[i].token_ids)):
            j = loads.index(min(loads))
            lanes[j].append(i)
            loads[j] += len(chunks[i].token_ids) + chunks[i].context_len // 4
        return [sorted(lane) for lane in lanes if lane]

    def forward_shared(
        self, chunks: list, cores, want: int, is_chunk_heavy: bool, on_layers=None
    ) -> torch.Tensor:
        """The pass on a host's shared cores (cores.CorePool), worth `want` of them. One prompt,
        or prompts each worth several cores (is_chunk_heavy: big matmuls), run every granted
        thread, resized between layers. Small ones go to the lanes, one thread each with no
        barrier between them, so lanes past the grant cost the others nothing: they only take
        the cycles left idle, as with a fixed split.
        NOTE: on lanes either way: their lower priority lets the frontend and decode steps
        sharing these cores run first (at the same priority those lost 25-40% of TPOT)."""
        is_split = len(self.split(chunks)) > 1
        num_tokens = sum(len(c.token_ids) for c in chunks)  # its end, predicted for yielders
        if want > 1 and (is_chunk_heavy or not is_split):
            grant = cores.begin(want, num_tokens=num_tokens, num_seqs=len(chunks))
            return self.forward_whole(chunks, grant, cores.between_layers, on_layers)
        cores.begin(min(want, len(chunks)), num_tokens=num_tokens, num_seqs=len(chunks))
        torch.set_num_threads(1)
        return self.forward(chunks, self.num_lanes if is_split else 1, on_layers)

    def forward(self, chunks: list, num_lanes: int | None = None, on_layers=None) -> torch.Tensor:
        num_lanes = num_lanes or self.num_lanes
        lanes = self.split(chunks, num_lanes)
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if len(lanes) == 1 and num_lanes > 1:
            is_lone = len(chunks) == 1 and chunks[0].prompt_targets is None
            if is_lone and num_tokens >= MIN_TOKENS_PER_PART * num_lanes:
                return self._forward_lone(chunks[0], num_lanes, on_layers)
            if num_tokens >= MIN_TOKENS_PER_THREAD * num_lanes or (
                len(chunks) == 1 and self.worth(num_tokens) >= num_lanes  # one piece either way
            ):
                return self.forward_whole(
                    chunks, num_lanes, None, on_layers
                )  # every thread on one long chunk
        parts = self._run([self._part(chunks, idx, 1, None) for idx in lanes], on_layers)
        if len(lanes) == 1:
            return parts[0]
        # NOTE: lanes write disjoint blocks of the one cache; the caller's sampling waits for all.
        order = torch.tensor([i for lane in lanes for i in lane])
        packed = torch.cat(parts)  # lane order -> chunk order
        last_hidden = torch.empty_like(packed)
        last_hidden[order] = packed
        return last_hidden


def split_tokens(num_tokens: int, context_len: int, num_parts: int, pair_cost: float) -> list[int]:
    """Offsets cutting a chunk of num_tokens after context_len into num_parts of equal cost:
    a token's matmuls (1) and its attention, pair_cost a (query, key) pair.
    -> [0, ..., num_tokens]. ValueError for more parts than tokens (a part of none)."""
    if not 1 <= num_parts <= num_tokens:
        raise ValueError(f"{num_tokens} tokens cannot make {num_parts} nonempty parts")

    def cost(t: float) -> float:
        return t + pair_cost * (context_len * t + t * t / 2)

    a, b = pair_cost / 2, 1 + pair_cost * context_len
    bounds = [0]
    for j in range(1, num_parts):
        target = cost(num_tokens) * j / num_parts
        t = (math.sqrt(b * b + 4 * a * target) - b) / (2 * a) if a > 0 else target / b
        bounds.append(min(max(int(round(t)), bounds[-1] + 1), num_tokens - (num_parts - j)))
    return bounds + [num_tokens]
