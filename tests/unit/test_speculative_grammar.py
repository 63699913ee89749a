"""Verify steps over rows whose mask depends on their tokens (a grammar, a bad word of
several tokens): each position is masked as if the drafts before it were made
(Matcher.fill_ahead) and the matcher ends as it began; the tokens equal transformers'
own masked greedy decoding and plain steps' (seeded draws too), with drafts all right,
every third wrong, and refused by the grammar; every block back at the end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.base.config import WorkerConfig
from common.base.grammar import bits_to_mask, for_model
from common.base.grammar_matcher import matcher_for
from common.base.recent import Recent
from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import num_blocks_for
from common.kv.prefix import PrefixCache
from common.kv.sequence import Sequence
from decode_node.batch import Batch
from decode_node.scheduler import DecodeScheduler
from tests.unit.test_speculative import _Oracle

PROMPTS = [[5, 6, 7, 8] * 4, [9, 8] * 3, [1, 2, 3, 4, 5] * 3 + [1], [11, 12, 13] * 5]
REGEX = ("regex", "[a-d]{2,4}(-[a-d]{2,4}){2,8}", "compact")
JSON = ("json_object", "", "compact")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def grammars(tiny_model):
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(str(tiny_model)).vocab_size
    return for_model(str(tiny_model), vocab_size, max_threads=1)


def _params(sampled: bool) -> list[SamplingParams]:
    """A regex, a JSON object, a bad word of two tokens (the first row's own run: it
    would be made) and a plain row: one batch; seeded draws where sampled."""
    extra = dict(temperature=0.8, seed=3) if sampled else {}
    return [
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, grammar=REGEX, **extra),
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, grammar=JSON, **extra),
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, bad_words_ids=[(2, 3)], **extra),
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **extra),
    ]


def _serve(model, grammars, params, spec, oracle=None) -> tuple[dict, dict, tuple]:
    """The node's turn over PROMPTS with params, the chooser taking every draft the rows
    have room for. -> (tokens per request, the worker's stats, (free, reserved) blocks)."""
    cfg = WorkerConfig(
        model=str(model), kv_cache_memory=8 * 2**20, max_batch_size=4, speculative=spec
    )
    out = {}
    with DeviceWorker(cfg) as w:
        cache = PrefixCache(w.num_kv_blocks)
        s = DecodeScheduler(cache, 16, 4, is_preemptive=False)
        b = Batch(w, s, SimpleNamespace(grammars=grammars), Recent(100))
        if oracle:
            w.decode.verifier.drafter = oracle
            b.drafts.choose = lambda keys, limit: limit
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            seq = Sequence(f"r{i}", len(prompt), p, prompt_ids=list(prompt))
            need = s.blocks_at_reserve(len(prompt), p.max_tokens)
            cache.reserve(need)
            seq.num_reserved = need
            for _ in range(num_blocks_for(len(prompt), 16)):
                seq.take_block(cache)
            chunk = PrefillChunk(prompt, 0, seq.block_ids, p)
            if p.is_masked_per_step:  # the first token's mask, as a prefill node makes it
                chunk.mask = matcher_for(p, [], w.spec.vocab_size, grammars).fill().clone()
            (first,), _ = w.prefill([chunk])
            s.admit(seq)
            b.join(seq, first, None, {})
            out[seq.request_id] = [first]
        running = b.launch()
        while running is not None:
            ahead = b.launch() if b.can_run_ahead() else None
            for update in b.collect(running, is_next_launched=ahead is not None):
                out[update.request_id].extend(update.token_ids)
            running = ahead if ahead is not None or not s.running else b.launch()
        return out, w.decode.stats(), (cache.num_free, cache.num_reserved)


def masked_greedy(model_dir, prompt: list[int], g: tuple, max_tokens: int) -> list[int]:
    """transformers' greedy tokens for prompt under grammar g, each step masked by the
    request's matcher, to the grammar's end (its EOS included) or max_tokens."""
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    grammars = for_model(str(model_dir), vocab_size, max_threads=1)
    p = SamplingParams(max_tokens=max_tokens, grammar=g)
    return _reference(model_dir, grammars, [p], [prompt], stop=grammars.info.stop_token_ids)[0]


def _reference(model_dir, grammars, params, prompts=PROMPTS, stop=()) -> list[list[int]]:
    """transformers' greedy tokens, each step masked by the request's matcher (to a stop
    token, if any, included)."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab_size = hf.config.vocab_size
    out = []
    for prompt, p in zip(prompts, params):
        m = matcher_for(p, [], vocab_size, grammars) if p.is_masked_per_step else None
        tokens: list[int] = []
        while len(tokens) < p.max_tokens and not (tokens and tokens[-1] in stop):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].float()
            if m is not None:
                allowed = bits_to_mask(m.fill()[None], vocab_size)[0]
                logits = logits.masked_fill(~allowed, float("-inf"))
            tokens.append(int(logits.argmax()))
            if m is not None:
                assert m.accept(tokens[-1])
        out.append(tokens)
    return out


def test_fill_ahead_masks_each_position_and_leaves_the_matcher_as_it_was(grammars):
    vocab_size = grammars.info.vocab_size
    p = SamplingParams(max_tokens=8, grammar=REGEX, bad_words_ids=[(5, 6)])
    m = matcher_for(p, [], vocab_size, grammars)
    allowed = bits_to_mask(m.fill()[None], vocab_size)[0].nonzero().flatten().tolist()
    step = matcher_for(p, [], vocab_size, grammars)
    drafts = []  # a path the grammar allows, token by token
    for _ in range(3):
        ok = bits_to_mask(step.fill()[None], vocab_size)[0].nonzero().flatten().tolist()
        drafts.append(ok[len(drafts) % len(ok)])
        assert step.accept(drafts[-1])
    before = m.fill().clone()
    refused = max(set(range(vocab_size)) - set(allowed))
    for tail in ([], [refused], [-1]):  # all allowed; a refused draft; none
        masks = m.fill_ahead(drafts + tail)
        assert masks.shape == (len(drafts) + len(tail) + 1, before.shape[0])
        again = matcher_for(p, [], vocab_size, grammars)
        for j in range(len(drafts) + 1):  # position j: as if drafts 0..j-1 were made
            assert torch.equal(masks[j], again.fill()), j
            if j < len(drafts):
                again.accept(drafts[j])
        if tail:  # past a draft its mask refuses: that position's mask again
            assert torch.equal(masks[-1], masks[-2])
        assert torch.equal(m.fill(), before)  # rolled back: the matcher as it began


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_grammar_rows_verify_drafts_and_answer_as_plain_steps(tiny_model, grammars, sampled):
    params = _params(sampled)
    plain, plain_stats, blocks = _serve(tiny_model, grammars, params, SpeculativeConfig("off"))
    assert plain_stats.get("num_verify_steps", 0) == 0
    if not sampled:  # plain steps under a grammar: transformers' own masked argmax
        assert list(plain.values()) == _reference(tiny_model, grammars, params)
    whole = [PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))]
    for wrong_every in (0, 3):  # every draft right; every third changed (refused, mostly)
        got, stats, got_blocks = _serve(
            tiny_model,
            grammars,
            params,
            SpeculativeConfig("ngram", 4),
            oracle=_Oracle(whole, wrong_every),
        )
        assert got == plain, wrong_every
        assert got_blocks == blocks and got_blocks[1] == 0
        assert stats["num_verify_steps"] > 0 and stats["num_accepted_tokens"] > 0
        if not wrong_every:  # right drafts under a grammar: far fewer steps
            assert stats["num_decode_steps"] * 2 < plain_stats["num_decode_steps"]
