"""CPU prefill lanes: one long prompt cut into runs of its tokens, a lane each, each run a
layer behind the one before (common/engine/lanes.py)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from common.engine.lanes import EXPLORE_EVERY, Lanes, run_on_own_thread, split_tokens

pytestmark = pytest.mark.unit


def _cost(a: int, b: int, context_len: int, pair_cost: float) -> float:
    return sum(1 + pair_cost * (context_len + t + 1) for t in range(a, b))


@pytest.mark.parametrize(
    "num_tokens,context_len,num_parts,pair_cost",
    [(2048, 0, 2, 0.0), (2048, 0, 2, 1e-3), (3000, 500, 3, 5e-4), (4096, 0, 4, 2e-3)],
)
def test_split_tokens_cuts_parts_of_equal_cost(num_tokens, context_len, num_parts, pair_cost):
    bounds = split_tokens(num_tokens, context_len, num_parts, pair_cost)
    assert bounds[0] == 0 and bounds[-1] == num_tokens and len(bounds) == num_parts + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    costs = [_cost(a, b, context_len, pair_cost) for a, b in zip(bounds, bounds[1:])]
    assert max(costs) / min(costs) < 1.01
    if pair_cost:  # attention grows along the prompt: the later runs are shorter
        assert all(
            b - a > d - c
            for (a, b), (c, d) in zip(zip(bounds, bounds[1:]), zip(bounds[1:], bounds[2:]))
        )


def test_split_tokens_keeps_every_part_nonempty():
    assert split_tokens(3, 0, 3, 10.0) == [0, 1, 2, 3]
    for num_tokens, num_parts in ((1, 2), (3, 5), (2, 0)):  # a part of none: refused
        with pytest.raises(ValueError):
            split_tokens(num_tokens, 5000, num_parts, 1e-3)


@dataclass
class _Chunk:
    token_ids: list[int]
    context_len: int = 0
    prompt_targets: list[int] | None = None


def _chunk(n: int) -> _Chunk:
    return _Chunk(list(range(n)))


def test_each_part_runs_a_layer_only_once_the_part_before_has_done_it():
    """Part j's layer l starts after part j - 1's layer l ended (its attention reads that KV);
    on_layers hears of the whole chunk's KV of a layer as the last part writes it (at its
    layer's start), every layer's."""
    num_layers, log, lock = 4, [], threading.Lock()

    def forward(chunks, between_layers=None, kv_written=None):
        part = chunks[0].context_len  # 0, then the first part's length
        for layer in range(num_layers):
            with lock:
                log.append(("start", part, layer, time.monotonic()))
            if kv_written is not None:
                kv_written(layer + 1)
            time.sleep(0.02 if part == 0 else 0.005)  # the first part slower: the second must wait
            with lock:
                log.append(("end", part, layer, time.monotonic()))
            if layer + 1 < num_layers:
                between_layers(layer + 1)
        return torch.full((1, 2), float(part))

    lanes, heard = Lanes(2, forward), []
    lanes.is_pipelined = True
    try:
        out = lanes.forward(
            [_chunk(2048)], on_layers=lambda idx, n: heard.append((list(idx), n, time.monotonic()))
        )
    finally:
        lanes.close()
    second = split_tokens(2048, 0, 2, 0.0)[1]
    assert torch.equal(out, torch.full((1, 2), float(second)))  # the last part's last hidden state
    at = {(kind, part, layer): t for kind, part, layer, t in log}
    for layer in range(num_layers):
        assert at[("start", second, layer)] >= at[("end", 0, layer)]
    heard = [h for h in heard if h[0]]
    assert [h[:2] for h in heard] == [([0], n) for n in range(1, num_layers + 1)]
    for _, n, t in heard:  # after the first part's layer ended: then the last part's began
        assert t >= at[("end", 0, n - 1)]


def test_a_part_that_fails_fails_the_pass_and_none_waits_forever():
    def forward(chunks, between_layers=None, kv_written=None):
        if chunks[0].context_len == 0:
            between_layers(1)
            raise RuntimeError("part 0 broke")
        for layer in range(1, 4):
            between_layers(layer)
        return torch.zeros(1, 2)

    lanes = Lanes(2, forward)
    lanes.is_pipelined = True
    done = []
    t = threading.Thread(target=lambda: done.append(_raises(lambda: lanes.forward([_chunk(2048)]))))
    t.start()
    t.join(10)
    lanes.close()
    assert done == ["part 0 broke"]


def _raises(fn) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def test_the_pair_cost_is_fitted_to_the_parts_cpu_times():
    """Times from t = k (x + p y) with p four times the first guess: each pass moves the
    guess half way there; a fit past eight times the guess stops at eight."""
    lanes = Lanes(1, lambda chunks, *hooks: None, pair_cost=1e-4)
    true_p, k = 4e-4, 1e-3
    parts = [(1200, 0), (848, 1200)]

    def times(p):
        return [k * (x + p * x * (c + x / 2)) for x, c in parts]

    for _ in range(12):
        lanes._fit_pair_cost(parts, times(true_p))
    assert lanes.pair_cost == pytest.approx(true_p, rel=1e-3)
    for _ in range(12):
        lanes._fit_pair_cost(parts, times(1e-2))
    assert lanes.pair_cost == pytest.approx(8e-4)
    lanes._fit_pair_cost(parts, [0.0, 1.0])  # nothing measured: left as it was
    assert lanes.pair_cost == pytest.approx(8e-4)
    lanes.close()


def test_a_chunk_of_a_few_hundred_tokens_is_cut_and_a_short_one_is_not():
    """From MIN_TOKENS_PER_PART a run the chunk is cut (each lane streams every weight: below
    that a run is mostly that); prompt logprobs keep one pass (every position's hidden state)."""
    from common.engine.lanes import MIN_TOKENS_PER_PART

    seen = []
    lanes = Lanes(
        2, lambda chunks, *hooks: seen.append(len(chunks[0].token_ids)) or torch.zeros(1, 2)
    )
    lanes.is_pipelined = True
    try:
        lanes.forward([_chunk(2 * MIN_TOKENS_PER_PART)])
        assert seen == [MIN_TOKENS_PER_PART, MIN_TOKENS_PER_PART]  # no pair cost given: equal runs
        seen.clear()
        lanes.forward([_chunk(2 * MIN_TOKENS_PER_PART - 1)])
        assert seen == [2 * MIN_TOKENS_PER_PART - 1]
        seen.clear()
        lanes.forward([_Chunk(list(range(4096)), 0, list(range(4096)))])
        assert seen == [4096]
    finally:
        lanes.close()


def test_a_short_lone_chunk_worth_every_thread_takes_them_all():
    """Defect: a lone chunk shorter than MIN_TOKENS_PER_PART a lane ran on one lane, so a
    prefill host of its own ran a 128-token prompt of Qwen3-0.6B on one of its two cores
    (300 ms; 205-215 as one pass on both). Where the chunk is worth every lane's thread
    (worth: pass_size.threads_worth) it runs as one pass on all of them, every time, never
    cut (a 1-token chunk cut in two was a run of no tokens: a node's crash); a tiny
    model's (worth one) stays on one lane."""
    from common.engine.lanes import MIN_TOKENS_PER_PART

    calls = []

    def forward(chunks, *hooks):
        calls.append((len(chunks[0].token_ids), torch.get_num_threads()))
        return torch.zeros(1, 2)

    for worth, threads in ((lambda n: 1, 1), (lambda n: 8, 2)):
        lanes = Lanes(2, forward, worth=worth)
        try:
            for n in (1, 2, MIN_TOKENS_PER_PART, 2 * MIN_TOKENS_PER_PART - 1):
                for chunk in (_chunk(n), _chunk(n), _Chunk(list(range(n)), 0, list(range(n)))):
                    calls.clear()  # (the last asks for prompt logprobs: one piece either way)
                    lanes.forward([chunk])
                    assert calls == [(n, threads)], (n, calls)
        finally:
            lanes.close()
        assert not lanes.token_s  # not the lone long chunks' choice of ways


def test_a_lone_chunk_runs_the_way_that_has_been_faster_here(monkeypatch):
    """Runs a layer apart were 12% slower than one pass on every lane's thread where the
    host's cores are this node's (10% faster beside a busy process). A lone chunk runs
    each way once, then whichever took less time a token, the other way every
    EXPLORE_EVERY-th chunk (so a host that changes is seen)."""
    from common.engine import lanes as lanes_mod

    clock, cost = [0.0], {"whole": 1.0, "runs": 1.0}  # seconds a call of each takes
    monkeypatch.setattr(lanes_mod.time, "perf_counter", lambda: clock[0])
    calls = []

    def forward(chunks, *hooks):
        calls.append(len(chunks[0].token_ids))
        clock[0] += cost["whole" if len(chunks[0].token_ids) == 1024 else "runs"]
        return torch.zeros(1, 2)

    lanes = Lanes(2, forward)

    def a_pass() -> str:
        calls.clear()
        lanes.forward([_chunk(1024)])
        return "runs" if len(calls) == 2 else "whole"  # runs: two calls, 2 s

    try:
        assert lanes.is_pipelined is None
        ways = [a_pass() for _ in range(EXPLORE_EVERY)]
        assert ways == ["whole", "runs"] + ["whole"] * (EXPLORE_EVERY - 3) + ["runs"]
        cost["whole"] = 4.0  # the host changed: one pass now slower than two runs
        ways = [a_pass() for _ in range(3)]
        assert ways[-1] == "runs", ways
    finally:
        lanes.close()


def test_a_long_prompt_pipelined_over_two_lanes_equals_one_pass_and_transformers(make_model):
    """A 2,100-token prompt on a two-thread worker: cut in two runs a layer apart, its KV,
    logits and first token equal the same worker's pass on both threads at once, and the
    logits equal transformers' on the same checkpoint."""
    from transformers import Qwen3ForCausalLM

    from common.base.config import WorkerConfig
    from common.base.request import SamplingParams
    from common.engine.worker import DeviceWorker, PrefillChunk

    model = make_model(layers=3, max_position_embeddings=4096)
    prompt = torch.randint(0, 400, (2100,), generator=torch.Generator().manual_seed(1)).tolist()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with DeviceWorker(WorkerConfig(model=str(model), kv_cache_memory=64 * 2**20)) as w:
            blocks = list(range(1, (len(prompt) + w.block_size - 1) // w.block_size + 1))
            runs, calls = {}, []
            pipelined = w.lanes.forward_pipelined
            w.lanes.forward_pipelined = lambda *a, **k: calls.append(1) or pipelined(*a, **k)
            for is_pipelined in (True, False):
                w.lanes.is_pipelined = is_pipelined
                tokens, logits = w.prefill(
                    [PrefillChunk(prompt, 0, blocks, SamplingParams(temperature=0))],
                    return_logits=True,
                )
                runs[is_pipelined] = tokens, logits, w.export_blocks(blocks)
            assert calls == [1]  # the first run only
    finally:
        torch.set_num_threads(before)
    (tok_p, logits_p, kv_p), (tok_w, logits_w, kv_w) = runs[True], runs[False]
    assert tok_p == tok_w and torch.allclose(logits_p, logits_w, atol=1e-4)
    assert torch.allclose(kv_p, kv_w, atol=1e-5)
    hf = Qwen3ForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(logits_p[0], ref, atol=1e-3) and tok_p[0] == int(ref.argmax())


def test_the_faster_way_is_found_by_work_not_tokens(monkeypatch):
    """A long prompt's second chunk (2,048 tokens of context) costs ~40% more a token than
    its first, and the two ways differ by ~10%: timed a token, the way that ran the second
    chunks looked slower whatever it was. Timed by work (split_tokens' cost), runs a layer
    apart that are 10% faster are found and kept."""
    from common.engine import lanes as lanes_mod

    clock, pair_cost, parts = [0.0], 2.6e-4, []
    monkeypatch.setattr(lanes_mod.time, "perf_counter", lambda: clock[0])

    def forward(chunks, *hooks):
        n, ctx = len(chunks[0].token_ids), chunks[0].context_len
        parts.append(n)
        clock[0] += 1e-3 * (n + pair_cost * (ctx * n + n * n / 2)) * (1.1 if n == 2048 else 1.0)
        return torch.zeros(1, 2)

    lanes = Lanes(2, forward, pair_cost=pair_cost)
    monkeypatch.setattr(lanes, "_fit_pair_cost", lambda *a: None)  # the fake clock fits nothing
    try:
        for _ in range(40):  # prompts of two 2,048-token chunks
            for ctx in (0, 2048):
                lanes.forward([_Chunk(list(range(2048)), ctx)])
    finally:
        lanes.close()
    num_in_runs = sum(n < 2048 for n in parts) // 2
    assert num_in_runs >= 60, num_in_runs  # of 80: all but the first and the explorations


def _tasks() -> set[str]:
    import os

    return set(os.listdir("/proc/self/task"))


def _is_libgomp() -> bool:
    """torch's OpenMP is GNU's (pip's torch): a pool's threads end with the thread that
    started it (Intel's keeps them for the process)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return False
    return "libgomp" in maps and "libiomp" not in maps


@pytest.mark.skipif(not _is_libgomp(), reason="torch's OpenMP is not libgomp")
def test_a_pass_on_several_threads_leaves_no_thread_pool_behind():
    """Defect: a lane that ran a pass on two threads kept the OpenMP pool it started (an
    idle thread) as long as the lane lived; with more threads pooled than the process has
    CPUs, libgomp stops letting idle pool threads spin, and every parallel region of the
    node's decode steps waited for a wake-up (attention at batch 1: 26 against 90 us a
    layer). Now such a pass runs on a thread that ends with it, pool and all; its result,
    its layers' hooks and its error come back as before."""
    seen = []

    def forward(chunks, between_layers=None, kv_written=None):
        a = torch.randn(256, 256)
        for _ in range(4):
            a = torch.tanh(a @ a)  # parallel regions on every thread granted
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        if kv_written is not None:
            kv_written(1)
        if len(chunks[0].token_ids) == 3:
            raise RuntimeError("this pass fails")
        return torch.full((len(chunks), 2), float(torch.get_num_threads()))

    lanes = Lanes(2, forward, worth=lambda n: 8)
    try:
        lanes.forward([_chunk(1)], 1)  # the lanes' threads start
        before = _tasks()
        heard = []
        out = lanes.forward_whole([_chunk(2)], 2, on_layers=lambda idx, n: heard.append((idx, n)))
        with pytest.raises(RuntimeError, match="this pass fails"):
            lanes.forward_whole([_chunk(3)], 2)
        deadline = time.monotonic() + 5
        while _tasks() - before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _tasks() - before  # no pool thread, no pass thread left
        assert out.tolist() == [[2.0, 2.0]] and ([0], 1) in heard
        assert seen[-2][0].startswith("prefill-lane") and seen[-2][0].endswith("-pass")
        lanes.forward([_chunk(4)], 1)
        assert seen[-1][1] == 1 and not seen[-1][0].endswith("-pass")  # one thread: the lane's
    finally:
        lanes.close()


def test_a_failed_pass_leaves_no_cycle_holding_its_tensors():
    """Defect: a failed pass's error, raised again on the lane and in the loop's thread,
    formed reference cycles (the raising frame held the error, or a future did) that kept
    the pass's tensors until the cyclic collector ran. Now they go with the error, on one
    lane's thread and on a pass thread of its own."""
    import gc
    import weakref

    refs = []

    def forward(chunks, between_layers=None, kv_written=None):
        activations = torch.zeros(4, 4)
        refs.append(weakref.ref(activations))
        raise RuntimeError("this pass fails")

    lanes = Lanes(2, forward, worth=lambda n: 1)
    gc.disable()
    try:
        for run in (
            lambda: lanes.forward([_chunk(3)], 1),
            lambda: lanes.forward_whole([_chunk(3)], 2),
        ):
            try:
                run()
            except RuntimeError as e:
                assert "this pass fails" in str(e)
            else:
                raise AssertionError("the pass's error was not raised")
            assert refs[-1]() is None
    finally:
        gc.enable()
        lanes.close()


def test_run_on_own_thread_returns_raises_and_outlives_no_interrupt():
    """Its result or its error on the caller's thread, from a thread named for it; an
    interrupt while it waits (Ctrl-C where Python's handler stands) is raised only once the
    thread has ended: nothing runs on beside the caller (a load left running had the
    process abort at exit)."""
    names = []
    assert run_on_own_thread(lambda: names.append(threading.current_thread().name) or 7, "x") == 7
    assert names == [f"{threading.current_thread().name}-x"]
    with pytest.raises(ZeroDivisionError):
        run_on_own_thread(lambda: 1 / 0)
    main = threading.main_thread()
    if threading.current_thread() is not main:
        pytest.skip("signals reach the main thread only")
    done = threading.Event()

    def is_waiting() -> bool:  # the caller is in run_on_own_thread's wait, past start()
        frame, codes = sys._current_frames().get(main.ident), set()
        while frame is not None:
            codes.add(frame.f_code)
            frame = frame.f_back
        return run_on_own_thread.__code__ in codes and threading.Thread.start.__code__ not in codes

    def interrupts_then_ends() -> None:
        # NOTE: fn itself interrupts its caller, once waiting: never after the call returned
        deadline = time.monotonic() + 60
        while not is_waiting():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        signal.pthread_kill(main.ident, signal.SIGINT)
        time.sleep(0.2)
        done.set()

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_on_own_thread(interrupts_then_ends)
        assert done.is_set()  # the wait went on to the thread's end
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_second_interrupt_abandons_the_wait_and_the_first_says_so():
    """The first interrupt says it waits for the thread's end; a second, while it still
    runs, is raised at once (a hung fn would otherwise need SIGKILL)."""
    main = threading.main_thread()
    if threading.current_thread() is not main:
        pytest.skip("signals reach the main thread only")
    release, done, said = threading.Event(), threading.Event(), threading.Event()
    raised = threading.Event()

    class Said(logging.Handler):  # NOTE: on the logger itself: pdserve's do not propagate
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for" in record.getMessage():
                said.set()

    def interrupts_twice() -> None:
        try:
            signal.pthread_kill(main.ident, signal.SIGINT)
            assert said.wait(60)
            # NOTE: sent again while nothing has been raised: a SIGINT that lands after the
            # main thread's last check for signals and before it blocks in its wait is seen
            # only at the next signal (CPython checks between bytecodes, not before a lock's
            # wait); sent at once after the warning it hit that window in 1 of 4 runs here,
            # as a person's third Ctrl-C would. fn runs on until the test has seen it.
            for _ in range(60):
                signal.pthread_kill(main.ident, signal.SIGINT)
                if raised.wait(2.0):
                    break
            release.wait(60)
        finally:
            done.set()

    handler, logger = Said(), logging.getLogger("pdserve.lanes")
    logger.addHandler(handler)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                run_on_own_thread(interrupts_twice)
            finally:
                raised.set()
        assert said.is_set() and not done.is_set()  # said, then abandoned while it ran
    finally:
        signal.signal(signal.SIGINT, old)
        logger.removeHandler(handler)
        release.set()
        assert done.wait(60)
