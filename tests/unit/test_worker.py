"""The device worker's life cycle, device-resident decode state, sampling and validation."""

import gc
import weakref

import pytest
import torch

from common.base.config import WorkerConfig
from common.base.request import SamplingParams, validate_prompt
from common.engine.sampling import sample
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator
from common.kv.sequence import Sequence, blocks_to_join
from launch.tools.offline import generate


def _worker(model, **kw):
    return DeviceWorker(WorkerConfig(model=str(model), kv_cache_memory=8 * 2**20, **kw))


def test_steady_decode_makes_no_host_to_device_writes(tiny_model):
    bs = 128
    with _worker(tiny_model, block_size=bs, max_batch_size=4) as worker:
        alloc = BlockAllocator(worker.num_kv_blocks)
        seqs = {}
        for i, prompt in enumerate([[1], [5, 6, 7], [9] * 20]):
            p = SamplingParams(max_tokens=200, ignore_eos=True)
            seq = Sequence(str(i), len(prompt), p, num_reserved=0)
            seq.num_reserved = seq.num_blocks_needed(bs)
            alloc.reserve(seq.num_reserved)
            seq.take_block(alloc)
            (tok,), _ = worker.prefill([PrefillChunk(prompt, 0, seq.block_ids, p)])
            blocks_to_join(seq, bs, alloc)
            worker.decode.add(seq.request_id, tok, len(prompt), seq.block_ids, p)
            seqs[seq.request_id] = seq
        before = worker.h2d.num_writes
        for _ in range(100):  # the longest reaches position 120 < 128: no crossing
            worker.decode.grow_blocks(seqs, alloc)
            worker.decode.step()
        assert worker.h2d.num_writes == before
        # The 20-token prompt's next token is at position 120; it enters block 1 at 128.
        while worker.decode.next_position("2") < bs:
            worker.decode.grow_blocks(seqs, alloc)
            worker.decode.step()
        bytes_before = worker.h2d.num_bytes
        before = worker.h2d.num_writes
        worker.decode.grow_blocks(seqs, alloc)
        worker.decode.step()  # the crossing step: one block-table entry, nothing else
        assert worker.h2d.num_writes == before + 1 and worker.h2d.num_bytes - bytes_before == 12
        assert worker.decode.num_blocks("2") == 2 and worker.stats()["num_block_writes"] == 1
        worker.decode.step()
        assert worker.h2d.num_writes == before + 1


def test_close_releases_weights_and_cache(tiny_model):
    worker = _worker(tiny_model).prepare()
    cache = weakref.ref(worker.kv_cache)
    weight = weakref.ref(worker.weights.layers[0].qkv)
    worker.prepare()  # a second prepare reuses what is there
    assert cache() is worker.kv_cache
    worker.close()
    gc.collect()
    assert cache() is None and weight() is None
    assert not worker.is_prepared
    worker.close()  # harmless


def test_context_manager_closes_on_exception(tiny_model):
    worker = _worker(tiny_model)
    with pytest.raises(RuntimeError):
        with worker:
            cache = weakref.ref(worker.kv_cache)
            raise RuntimeError("boom")
    gc.collect()
    assert cache() is None and not worker.is_prepared


def test_kv_budget_sets_capacity(tiny_model):
    with _worker(tiny_model, block_size=16) as worker:
        per_block = 2 * worker.spec.num_layers * worker.spec.kv_size * 4 * 16
        assert worker.num_kv_blocks == 8 * 2**20 // per_block
        assert worker.token_capacity == (worker.num_kv_blocks - 1) * 16
        assert worker.kv_cache.numel() * 4 <= 8 * 2**20


def test_removing_a_row_keeps_the_others_exact(tiny_model):
    """Rows leave from the middle of the batch; the rest keep their tokens."""
    prompts = [[3, 4, 5], [7] * 17, [11, 12]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 40, 30)]
    with _worker(tiny_model) as worker:
        together = generate(worker, prompts, params)
    for prompt, p, r in zip(prompts, params, together):
        with _worker(tiny_model) as worker:
            alone = generate(worker, [prompt], [p])[0]
        assert alone["token_ids"] == r["token_ids"]


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny_model):
    prompts = [[1, 2, 3], [4, 5, 6, 7]]

    def mk(seed):
        return SamplingParams(
            max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=seed, ignore_eos=True
        )

    with _worker(tiny_model) as worker:
        a = generate(worker, prompts, [mk(1), mk(2)])
        b = generate(worker, prompts, [mk(1), mk(2)])
        alone = generate(worker, prompts[1:], [mk(2)])
        other = generate(worker, prompts[:1], [mk(3)])
    assert a[0]["token_ids"] == b[0]["token_ids"] and a[1]["token_ids"] == b[1]["token_ids"]
    assert alone[0]["token_ids"] == a[1]["token_ids"]
    assert other[0]["token_ids"] != a[0]["token_ids"]


def test_sample_respects_top_k_top_p_and_greedy():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    best = logits.argmax(-1)
    n = 4
    t = torch.tensor([0.0, 1.0, 1.0, 5.0])
    out = sample(
        logits,
        t,
        torch.tensor([1.0, 1.0, 1e-6, 1.0]),
        torch.tensor([-1, 1, -1, 3]),
        torch.arange(n),
        torch.zeros(n, dtype=torch.long),
    )
    assert out[0] == best[0] and out[1] == best[1] and out[2] == best[2]
    top3 = set(logits[3].topk(3).indices.tolist())
    draws = {
        sample(
            logits[3:],
            t[3:],
            torch.ones(1),
            torch.tensor([3]),
            torch.tensor([s]),
            torch.zeros(1, dtype=torch.long),
        ).item()
        for s in range(200)
    }
    assert draws <= top3 and len(draws) == 3


def test_sampling_distribution_follows_probabilities():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = torch.zeros(3)
    for s in range(3000):
        counts[
            sample(
                logits,
                torch.ones(1),
                torch.ones(1),
                torch.tensor([-1]),
                torch.tensor([s]),
                torch.tensor([7]),
            ).item()
        ] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_eos_and_stop_tokens_end_generation(tiny_model):
    with _worker(tiny_model) as worker:
        free = generate(worker, [[1, 2, 3]], [SamplingParams(max_tokens=20, ignore_eos=True)])[0]
        stop_at = free["token_ids"][5]
        first = free["token_ids"].index(stop_at)
        stopped = generate(
            worker, [[1, 2, 3]], [SamplingParams(max_tokens=20, stop_token_ids=(stop_at,))]
        )[0]
        assert stopped["token_ids"] == free["token_ids"][: first + 1]
        assert stopped["finish_reason"] == "stop"
        object.__setattr__(worker.spec, "eos_token_ids", (stop_at,))
        eos = generate(worker, [[1, 2, 3]], [SamplingParams(max_tokens=20)])[0]
        assert eos["token_ids"] == stopped["token_ids"] and eos["finish_reason"] == "stop"
        ignored = generate(worker, [[1, 2, 3]], [SamplingParams(max_tokens=20, ignore_eos=True)])[0]
        assert ignored["token_ids"] == free["token_ids"]


@pytest.mark.parametrize(
    "params,match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=(10**6,)), "stop_token_ids"),
    ],
)
def test_bad_sampling_params_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params).validate(vocab_size=512)


@pytest.mark.parametrize(
    "prompt,max_tokens,match",
    [
        ([], 4, "empty"),
        ([1, 512], 4, "outside the vocabulary"),
        ([1, -1], 4, "outside the vocabulary"),
        ([1] * 1000, 25, "maximum length"),
    ],
)
def test_bad_prompts_are_named(prompt, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        validate_prompt(prompt, max_tokens, vocab_size=512, max_model_len=1024)


def test_generate_rejects_too_long_request(tiny_model):
    with _worker(tiny_model) as worker:
        with pytest.raises(ValueError, match="maximum length"):
            generate(worker, [[1] * 1000], [SamplingParams(max_tokens=100)])


def test_generate_cli_json(tiny_model, capsys):
    import json

    from launch import generate as gen_cli

    gen_cli.main(
        [
            "--model",
            str(tiny_model),
            "--prompt",
            "hello there",
            "--prompt",
            "café",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--json",
        ]
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 2
    for r in lines:
        assert len(r["token_ids"]) == 8 and isinstance(r["text"], str)
        assert r["ttft_ms"] > 0 and r["decode_ms_per_step"] > 0


def test_a_decode_step_without_a_core_table_runs_on_the_threads_it_is_worth(tiny_model):
    """Defect: the worker puts its loop thread on one torch thread (the prefill lanes), and a
    decode step with no core table to ask kept that one: a large model's step streamed its
    weights on one core of several. A step now takes min(the node's threads, what a step of
    its rows is worth), and gives the loop thread back its one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a node of two threads (the tests may run on one)
    try:
        _check_decode_threads(tiny_model)
    finally:
        torch.set_num_threads(before)


def _check_decode_threads(tiny_model):
    with _worker(tiny_model, max_batch_size=4) as worker:
        d, r = worker.decode, worker.decode.runner
        assert r.num_threads == worker.num_threads and r.threads_worth(1) == 1  # tiny: one
        alloc = BlockAllocator(worker.num_kv_blocks)
        p = SamplingParams(max_tokens=50, ignore_eos=True)
        for i in range(3):
            blocks = alloc.allocate(1)
            (tok,), _ = worker.prefill([PrefillChunk([1, 2, 3], 0, blocks, p)])
            d.add(str(i), tok, 3, blocks, p)
        seen, run = [], d._run

        def spy(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return run(*args, **kwargs)

        d._run = spy
        d.step()  # worth one thread (a tiny model)
        asked = []
        d.runner.threads_worth = lambda num_rows: asked.append(num_rows) or 5  # a large model's
        d.step()
        assert worker.num_threads == 2 and seen == [1, 2] and asked == [3]  # the step's rows
        assert torch.get_num_threads() == 1  # the loop thread's own again

        class Table:  # a core table: asked for what a step of its rows is worth
            def begin(self, want, yields=False, while_waiting=None, num_seqs=0):
                asked.append((want, yields))
                while_waiting(0.002)  # as a yield would, inside the step
                torch.set_num_threads(2)
                return 2

            def between_layers(self, num_done):
                pass

            def end(self):
                asked.append("end")

        d.runner.cores = Table()
        d.runner.threads_worth = lambda num_rows: 10 * num_rows
        # the node's hook (it reads its links): out of the step's inference mode, where a
        # tensor a tcp landing made could not be updated by a later turn (review: a crash)
        d.runner.while_yielding = lambda timeout_s: asked.append((timeout_s, is_inference()))
        is_inference = torch.is_inference_mode_enabled
        d.step()
        assert asked == [3, (30, True), (0.002, False), "end"] and seen[-1] == 2


def test_a_rows_draw_is_its_own_alone_or_beside_filtered_rows():
    """A row's token depends on its logits, params, seed and position alone: the same
    whether its batch takes the sort (a row with top-k or top-p) or not, and ties at a
    top-k floor are all kept (decided by value, not by the sort's order of ties)."""
    torch.manual_seed(0)
    n, vocab = 12, 5000
    logits = torch.randn(n, vocab) * 3
    temp = torch.rand(n) + 0.3
    top_p = torch.where(torch.arange(n) % 3 == 0, torch.rand(n), torch.ones(n))
    top_k = torch.where(torch.arange(n) % 4 == 1, torch.randint(1, 50, (n,)), torch.full((n,), -1))
    seeds, pos = torch.arange(n) + 7, torch.arange(n) + 100
    together = sample(logits, temp, top_p, top_k, seeds, pos)
    for i in range(n):
        row = [t[i : i + 1] for t in (logits, temp, top_p, top_k, seeds, pos)]
        assert sample(*row) == together[i]
        assert sample(*row, is_filtered=True) == together[i]
    tied = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    draws = {
        sample(tied, torch.ones(1), torch.ones(1), torch.tensor([2]), torch.tensor([s]), pos[:1])
        for s in range(300)
    }
    assert {int(d) for d in draws} == {1, 2, 3}


def test_a_worker_gives_the_calling_thread_its_threads_back_at_close(tiny_model):
    """A worker on the CPU leaves the calling thread one thread for its loop's small ops;
    at close it gives back what it found, or the next worker in the process (a benchmark's
    second side, a test's next) would take one thread for all its work."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with _worker(tiny_model) as worker:
            assert worker.num_threads == 2 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with _worker(tiny_model) as worker:
            assert worker.num_threads == 2
    finally:
        torch.set_num_threads(before)


def test_a_top_p_below_float32s_least_keeps_the_likeliest_token():
    """Found by the API fuzz: top_p=5e-324 is in (0, 1] but 0 in float32, and every token
    was dropped: the sampler indexed the floor at -1 and the prefill node died."""
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]] * 2)
    tiny = torch.tensor([5e-324, 1e-60], dtype=torch.float64).float()
    assert (tiny == 0).all()
    top_k, seeds = torch.tensor([-1, 2]), torch.arange(2)
    got = sample(logits, torch.ones(2), tiny, top_k, seeds, torch.zeros(2, dtype=torch.long))
    assert got.tolist() == [1, 1]


def test_a_large_vocabularys_rows_draw_as_a_batch_would():
    """On the CPU a large vocabulary's noise is made a row at a time (fresh pages cost more
    than hashing): the same draws as the batch's."""
    from common.engine import sampling

    torch.manual_seed(1)
    n, vocab = 3, sampling.ROW_AT_A_TIME + 7
    scaled, seeds, pos = torch.randn(n, vocab), torch.arange(n) + 11, torch.arange(n) + 5
    noise = sampling.uniform_noise(seeds, pos, vocab)
    batched = (scaled - torch.log(-torch.log(noise))).argmax(-1)
    assert sampling._gumbel_argmax(scaled, seeds, pos).tolist() == batched.tolist()


def test_noise_of_one_never_draws_a_masked_token():
    """Found in review: (2**24 - 0.5) / 2**24 rounds to 1.0 in float32; its token's Gumbel
    noise was +inf (NaN where masked) and won against top-k and every mask, ~0.9% of
    draws at Qwen3's vocabulary. Seed 44 at position 0 hits one at token 149155."""
    vocab = 151936
    logits = torch.full((2, vocab), float("-inf"))
    logits[0] = 0.0
    logits[:, 7] = 50.0
    one = torch.ones(2)
    got = sample(logits, one, one, torch.tensor([1, -1]), torch.tensor([44, 44]), torch.zeros(2))
    assert got.tolist() == [7, 7]


def test_a_row_with_every_token_masked_reports_finite_logprobs():
    """Found in review: a processed log-probability of a fully masked row was NaN, which
    the wire refuses for the whole batch of updates."""
    from common.engine.logits import LOGPROB_FLOOR, to_host

    nan = float("nan")
    (got,) = to_host([nan], [[nan, float("-inf")]], [[0, 1]], [2])
    assert got.logprob == LOGPROB_FLOOR and got.top_logprobs == [LOGPROB_FLOOR] * 2


def test_a_steps_host_time_counts_its_masks_upload(tiny_model):
    """On a host without device events a step's time is its launch's: its masks' upload
    (a verify step's grows with k) counts, which the draft chooser and the frontend's
    route choice read. Review: a split of the launch timed the step from after it."""
    import time

    with _worker(tiny_model, max_batch_size=2) as worker:
        d = worker.decode
        alloc = BlockAllocator(worker.num_kv_blocks)
        p = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.7, top_k=5, seed=1)
        blocks = alloc.allocate(1)
        (tok,), _ = worker.prefill([PrefillChunk([1, 2, 3], 0, blocks, p)])
        d.add("a", tok, 3, blocks, p)
        upload = d.sampling.upload_masks
        d.sampling.upload_masks = lambda *a: time.sleep(0.05) or upload(*a)
        ticket = d.launch()
        d.collect(ticket)
        assert ticket.busy_s >= 0.05
