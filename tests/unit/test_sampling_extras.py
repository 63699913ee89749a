"""Log-probabilities, penalties and masks in the worker, the prefill node's first token
and the decode batch alike, against transformers' logits and a reference sampler
written here. A request that asks for none of it is sampled exactly as before."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.engine.sampling import sample
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from launch.tools.offline import generate

PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 77, 12], [300, 301, 5, 5, 9], list(range(40, 75))]


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def worker(tiny_model):
    with DeviceWorker(
        WorkerConfig(model=str(tiny_model), kv_cache_memory=4 * 2**20, max_batch_size=8)
    ) as w:
        yield w


def _logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


# ---- the reference: what each control does to the logits, written out --------------


def _reference_process(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int], eos: tuple[int, ...]
) -> torch.Tensor:
    x = logits.clone()
    for t, b in zip(p.logit_bias_ids, p.logit_bias):
        x[t] += b
    if p.allowed_token_ids:
        keep = torch.full_like(x, float("-inf"))
        keep[list(p.allowed_token_ids)] = 0
        x = x + keep
    for w in p.bad_words_ids:
        if len(w) == 1:
            x[w[0]] = float("-inf")
    if len(out) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)):
            x[t] = float("-inf")
    for t in set(prompt) | set(out):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] = x[t] - p.frequency_penalty * out.count(t) - p.presence_penalty
    return x


def _reference(hf, prompt: list[int], p: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    """Token by token from transformers' logits, processed as written above; the draw
    itself (the counter-based noise) is the engine's."""
    out: list[int] = []
    for _ in range(p.max_tokens):
        x = _reference_process(_logits(hf, prompt + out)[-1], p, prompt, out, eos)[None]
        pos = torch.tensor([len(prompt) + len(out)])
        if p.is_greedy:
            tok = int(x.argmax())
        else:
            tok = int(
                sample(
                    x,
                    torch.tensor([p.temperature]),
                    torch.tensor([p.top_p]),
                    torch.tensor([p.top_k]),
                    torch.tensor([p.seed]),
                    pos,
                    torch.tensor([p.min_p]),
                )[0]
            )
        out.append(tok)
    return out


CONTROLS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.0, presence_penalty=-0.5),
    "repetition": dict(repetition_penalty=1.75),
    "bias": dict(logit_bias_ids=(7, 11, 300), logit_bias=(4.0, 3.5, -100.0)),
    "allowed": dict(allowed_token_ids=(20, 21, 22, 23, 24, 25)),
    "bad-words": dict(),  # chosen from what it would say
    "min-p": dict(min_p=0.5, temperature=0.9, seed=3),
    "all-sampled": dict(
        presence_penalty=0.75,
        frequency_penalty=0.25,
        repetition_penalty=1.25,
        temperature=1.1,
        top_k=50,
        seed=11,
        logit_bias_ids=(5,),
        logit_bias=(2.0,),
    ),
}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_control_equals_the_reference_sampler(worker, hf, name):
    p = SamplingParams(max_tokens=12, ignore_eos=True, **CONTROLS[name])
    base = SamplingParams(
        max_tokens=12, ignore_eos=True, temperature=p.temperature, seed=p.seed, top_k=p.top_k
    )
    uncontrolled = [g["token_ids"] for g in generate(worker, PROMPTS, [base] * len(PROMPTS))]
    if name == "bad-words":  # words it would say: two of its tokens, and a pair it would not
        p = dataclasses.replace(
            p, bad_words_ids=((uncontrolled[0][0],), (uncontrolled[1][0],), (99, 100))
        )
    got = generate(worker, PROMPTS, [p] * len(PROMPTS))
    for prompt, g in zip(PROMPTS, got):
        assert g["token_ids"] == _reference(hf, prompt, p, worker.spec.eos_token_ids), name
    assert [g["token_ids"] for g in got] != uncontrolled  # the control did something


def test_min_tokens_holds_back_eos_and_stop_tokens(worker, hf):
    eos = worker.spec.eos_token_ids
    base = SamplingParams(max_tokens=10, temperature=0.0)
    # Make the stop token the likeliest by far: without min_tokens it ends the request at once.
    stop = 123
    biased = dict(logit_bias_ids=(stop,), logit_bias=(50.0,), stop_token_ids=(stop,))
    plain = generate(worker, [PROMPTS[0]], [dataclasses.replace(base, **biased)])[0]
    assert plain["token_ids"] == [stop] and plain["finish_reason"] == "stop"
    held = dataclasses.replace(base, min_tokens=4, **biased)
    got = generate(worker, [PROMPTS[0]], [held])[0]
    assert (
        got["token_ids"] == _reference(hf, PROMPTS[0], held, eos)[:5]
        and got["token_ids"][4] == stop
    )
    assert stop not in got["token_ids"][:4] and got["finish_reason"] == "stop"


def test_logprobs_equal_transformers(worker, hf):
    p = SamplingParams(max_tokens=6, ignore_eos=True, num_logprobs=5)
    got = generate(worker, PROMPTS, [p] * len(PROMPTS))
    for prompt, g in zip(PROMPTS, got):
        logp = torch.log_softmax(_logits(hf, prompt + g["token_ids"]), dim=-1)
        assert len(g["logprobs"]) == len(g["token_ids"]) == 6
        for i, (tok, lp) in enumerate(zip(g["token_ids"], g["logprobs"])):
            ref = logp[len(prompt) - 1 + i]
            assert lp.logprob == pytest.approx(ref[tok].item(), abs=1e-4)
            assert lp.top_ids == ref.topk(5).indices.tolist()
            assert lp.top_logprobs == pytest.approx(ref.topk(5).values.tolist(), abs=1e-4)


def test_processed_logprobs_are_of_the_distribution_sampled(worker, hf):
    p = SamplingParams(
        max_tokens=4,
        ignore_eos=True,
        num_logprobs=3,
        is_processed_logprobs=True,
        temperature=0.7,
        top_k=40,
        presence_penalty=1.0,
        seed=5,
    )
    prompt = PROMPTS[1]
    g = generate(worker, [prompt], [p])[0]
    for i, (tok, lp) in enumerate(zip(g["token_ids"], g["logprobs"])):
        x = _reference_process(
            _logits(hf, prompt + g["token_ids"][:i])[-1], p, prompt, g["token_ids"][:i], ()
        )
        x = x / p.temperature
        x[x < x.topk(40).values[-1]] = float("-inf")
        ref = torch.log_softmax(x, dim=-1)
        assert lp.logprob == pytest.approx(ref[tok].item(), abs=1e-4)
        assert lp.top_ids == ref.topk(3).indices.tolist()


def test_prompt_logprobs_equal_transformers_across_chunks(worker, hf):
    prompt = PROMPTS[2]
    alloc = BlockAllocator(worker.num_kv_blocks)
    blocks = alloc.allocate(num_blocks_for(len(prompt), worker.block_size))
    p = SamplingParams(max_tokens=1, num_prompt_logprobs=2)
    got = []
    for start, end in ((0, 13), (13, 30), (30, len(prompt))):  # a prompt prefilled in three chunks
        is_last = end == len(prompt)
        c = PrefillChunk(
            prompt[start:end],
            start,
            blocks,
            p if is_last else None,
            prompt_targets=prompt[start + 1 : end + 1] + ([-1] if is_last else []),
            num_prompt_logprobs=2,
        )
        worker.prefill([c])
        got += c.prompt_logprobs
    alloc.free(blocks)
    logp = torch.log_softmax(_logits(hf, prompt), dim=-1)
    assert len(got) == len(prompt) - 1
    for i, lp in enumerate(got):
        assert lp.logprob == pytest.approx(logp[i, prompt[i + 1]].item(), abs=1e-4)
        assert lp.top_ids == logp[i].topk(2).indices.tolist()


def test_a_plain_request_is_sampled_as_before_beside_the_full_path(worker):
    """A batch with rows on the full path: the plain rows' tokens equal those of the same
    requests in a batch of plain rows (greedy and seeded)."""
    plain = [
        SamplingParams(max_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=9),
    ]
    alone = generate(worker, PROMPTS[:2], plain)
    mixed = generate(
        worker,
        PROMPTS,
        plain
        + [SamplingParams(max_tokens=10, ignore_eos=True, num_logprobs=2, repetition_penalty=1.5)],
    )
    assert [g["token_ids"] for g in mixed[:2]] == [g["token_ids"] for g in alone]
    assert all(lp is None for g in mixed[:2] for lp in g["logprobs"])


def test_penalties_keep_the_decode_step_free_of_host_copies(worker):
    """Rows' penalty state lives on the device: once joined, a step copies nothing in."""
    p = SamplingParams(
        max_tokens=30, ignore_eos=True, presence_penalty=1.0, repetition_penalty=1.2, num_logprobs=3
    )
    alloc = BlockAllocator(worker.num_kv_blocks)
    prompt = PROMPTS[0]
    blocks = alloc.allocate(num_blocks_for(len(prompt) + 30, worker.block_size))
    (tok,), _ = worker.prefill([PrefillChunk(prompt, 0, blocks, p, history=(prompt, []))])
    worker.decode.add("r", tok, len(prompt), blocks, p, (prompt, [tok]))
    worker.decode.step()
    before = worker.h2d.num_writes
    for _ in range(5):  # within the blocks it holds: no block crossing either
        worker.decode.step()
    assert worker.h2d.num_writes == before
    worker.decode.remove("r")
    alloc.free(blocks)


def test_a_grammar_that_ended_masks_to_eos_alone(tiny_model):
    """ignore_eos under a grammar: the matcher accepts EOS and ends; it is asked for a
    mask again every step after (xgrammar itself refuses): EOS alone, step after step,
    and a matcher made again from those tokens (a move, a preemption) says the same."""
    from transformers import AutoConfig, AutoTokenizer

    from common.base.grammar import bits_to_mask, for_model
    from common.base.grammar_matcher import matcher_for

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    vocab_size = AutoConfig.from_pretrained(str(tiny_model)).vocab_size
    grammars = for_model(str(tiny_model), vocab_size)
    params = SamplingParams(max_tokens=20, ignore_eos=True, grammar=("choice", '["ab"]', "compact"))
    m = matcher_for(params, [], vocab_size, grammars)
    eos = grammars.info.stop_token_ids
    out = []
    while True:
        allowed = bits_to_mask(m.fill()[None], vocab_size)[0].nonzero().flatten().tolist()
        if set(allowed) <= set(eos):
            break
        out.append(next(t for t in tok.encode("ab") if t in allowed))
        assert m.accept(out[-1])
    assert tok.decode(out) == "ab"
    for _ in range(3):  # EOS, again and again
        assert m.accept(eos[0])
        assert bits_to_mask(m.fill()[None], vocab_size)[0].nonzero().flatten().tolist() == sorted(
            eos
        )
    again = matcher_for(params, out + [eos[0]] * 3, vocab_size, grammars)
    assert torch.equal(again.fill(), m.fill())


def test_a_grammar_xgrammar_fails_on_without_a_word_is_refused_naming_why(tiny_model, monkeypatch):
    """Defect: xgrammar fails without a word on a number past a double's range (a
    schema's "minimum": 1e400), and the error's own wording then raised an IndexError:
    a 400 that named only that type."""
    from common.base.grammar import GrammarError, for_model

    grammars = for_model(str(tiny_model), 512, max_threads=1)
    schema = '{"type": "integer", "minimum": 1e400}'
    with pytest.raises(GrammarError, match="cannot be compiled: the number 1e400 is out of range"):
        grammars.compile(("json_schema", schema, "compact"))
    schema = '{"type": "integer", "minimum": 1' + "0" * 400 + "}"  # past 64 bits: the same
    with pytest.raises(GrammarError, match="cannot be compiled: the number 1000+ is out of"):
        grammars.compile(("json_schema", schema, "compact"))

    def silent(*args, **kwargs):
        raise RuntimeError()

    monkeypatch.setattr(grammars._compiler, "compile_regex", silent)
    with pytest.raises(GrammarError, match="the regex cannot be compiled: RuntimeError$"):
        grammars.compile(("regex", "a+", "compact"))


def test_a_node_compiles_grammars_beside_its_loop(tiny_model):
    """Defect: a node compiled each request's grammar on its loop: a client streaming
    distinct grammars just under the frontend's 0.5 s limit stalled every running
    sequence about that long each. Compiles runs them on a thread of their own (xgrammar
    lets go of the GIL): the loop keeps turning meanwhile, and a grammar compiled is kept
    with its request whatever else is compiled, never compiled again on the loop."""
    import json
    import threading
    import time

    from common.base.grammar import Compiles, GrammarError, for_model
    from common.base.grammar_matcher import matcher_for
    from common.base.model_spec import load_spec

    vocab_size = load_spec(str(tiny_model)).vocab_size
    made = []

    def make():
        made.append(threading.current_thread().name)
        return for_model(str(tiny_model), vocab_size, max_threads=1)

    compiles = Compiles(make)
    schema = {"type": "integer"}
    for i in range(8):  # about 0.1-0.3 s to compile on one thread
        schema = {
            "type": "object",
            "properties": {f"k{i}": schema, "a": {"type": "array", "items": schema}},
            "required": [f"k{i}"],
        }
    grammar = ("json_schema", json.dumps(schema), "compact")
    compiles.submit("r", grammar)
    compiles.submit("bad", ("regex", "(", "compact"))
    turns = 0
    while not (compiles.is_done("r") and compiles.is_done("bad")):  # the loop turns meanwhile
        turns += 1
        time.sleep(0.001)
    assert turns > 10
    assert made and made[0].startswith("grammar")  # the tokenizer's vocabulary too
    compiled = compiles.take("r")
    with pytest.raises(GrammarError, match="regex does not compile"):
        compiles.take("bad")
    params = SamplingParams(max_tokens=5, grammar=grammar)
    before = dict(compiles.grammars._compiled)
    compiles.grammars._compiled.clear()  # as if others had evicted it
    m = matcher_for(params, [], vocab_size, compiles.grammars, compiled)
    assert not compiles.grammars._compiled and m.fill().any()  # not compiled again
    assert before
    compiles.submit("gone", grammar)
    compiles.drop("gone")
    assert not compiles.is_done("gone")
    compiles.close()


def test_no_grammar_compile_outlives_its_request_on_either_node():
    """Defects: the prefill node submitted a grammar's compile before the handoff began,
    so a request whose handoff could not begin (LinkError) failed with its compile kept for
    good; the decode node dropped a committed group's compile at choice 0's abort, compiled
    it again for the others, and kept it once the last was aborted."""
    import threading
    from types import SimpleNamespace

    from common.base import grammar
    from common.base.recent import Recent
    from common.kv.blocks import BlockAllocator
    from common.wire.channel import LinkError
    from common.wire.protocol import PrefillRequest
    from decode_node.grammar_wait import GrammarWait
    from decode_node.node import DecodeNode
    from decode_node.scheduler import DecodeScheduler
    from prefill_node.grammars import PrefillGrammars
    from prefill_node.node import PrefillNode
    from tests.handoff_util import receiver
    from tests.unit.test_grants import _commit_group

    prefill = object.__new__(PrefillNode)
    prefill.grammars = PrefillGrammars(
        lambda: SimpleNamespace(compile=lambda g: ("compiled", g)), vocab_size=100
    )
    prefill.worker = SimpleNamespace(spec=SimpleNamespace(vocab_size=100), max_model_len=1024)
    prefill.scheduler = SimpleNamespace(fits_at_all=lambda n: True, add=lambda job: None)
    prefill.cfg = SimpleNamespace(allow_remote=False)

    def no_link(job):
        raise LinkError("no key for decode-9")

    prefill.handoffs = SimpleNamespace(holds=lambda rid: False, begin=no_link)
    failed = []
    prefill._fail = lambda rid, err, is_retryable=False: failed.append(rid)
    prefill._accept(
        PrefillRequest(
            "r0",
            [1, 2, 3],
            SamplingParams(max_tokens=4, grammar=("regex", "a", "compact")),
            0.0,
            "decode-9",
            "tcp://127.0.0.1:9",
        )
    )
    assert failed == ["r0"] and prefill.grammars.compiles.keys() == []
    prefill.grammars.close()

    gate = threading.Event()
    node = object.__new__(DecodeNode)
    node.compiles = grammar.Compiles(
        lambda: SimpleNamespace(compile=lambda g: gate.wait(5) and ("compiled", g))
    )
    node.grammars = GrammarWait(node.compiles)
    node.scheduler = DecodeScheduler(BlockAllocator(80), 4, 4)
    node.handoff = receiver(node.scheduler)
    node.local = SimpleNamespace(abort=lambda rid: False, run=lambda: None)
    node.preemption = SimpleNamespace(resume_all=lambda: None)
    node.pending_aborts, node.ended = set(), Recent(64)
    _commit_group(
        node.handoff,
        "g",
        ["g1"],
        params=SamplingParams(max_tokens=6, grammar=("regex", "a+", "compact")),
    )
    assert node._admit() == [] and node.compiles.keys() == ["g"]  # it waits for its grammar
    node._abort("g")  # choice 0 given up: the other goes on
    node._admit()
    node._abort("g1")  # the last: the group is gone, and its compile
    gate.set()
    assert "g" not in node.handoff.held and node.compiles.keys() == []
    node.compiles.close()
