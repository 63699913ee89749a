"""Verify steps under sampling's rules: rows that ask for log-probabilities and rows with
penalties, a bias and fixed masks verified as plain steps would choose, and verified draws
that follow the model's distribution (against transformers' own Qwen3)."""

import pytest
import torch

from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig
from common.engine.worker import PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from launch.tools.offline import generate
from tests.unit.test_speculative import _Oracle, _worker


@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
def test_verified_tokens_report_the_log_probabilities_plain_steps_do(tiny_model, processed):
    """Rows that ask for log-probabilities are verified too: each token's, and its
    likeliest alternatives', equal to plain decoding's (a greedy row and a sampled one
    with top-p, raw or of the distribution sampled from, beside a row that asks none)."""
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44], [7, 8]]
    asked = dict(ignore_eos=True, is_processed_logprobs=processed)
    params = [
        SamplingParams(max_tokens=21, num_logprobs=3, **asked),
        SamplingParams(max_tokens=17, num_logprobs=0, temperature=0.8, top_p=0.9, seed=5, **asked),
        SamplingParams(max_tokens=19, ignore_eos=True, temperature=0.8, seed=6),
    ]
    with _worker(tiny_model, spec=SpeculativeConfig("off")) as worker:
        plain = generate(worker, prompts, params)
    whole = [p + r["token_ids"] for p, r in zip(prompts, plain)]
    with _worker(tiny_model) as worker:
        worker.decode.verifier.drafter = _Oracle(whole, wrong_every=4)
        got = generate(worker, prompts, params)
        v = worker.decode.verifier
        assert v.num_steps > 0 and 0 < v.num_accepted < v.num_drafted
    for mine, theirs, p in zip(got, plain, params):
        assert mine["token_ids"] == theirs["token_ids"]
        if p.num_logprobs < 0:
            assert all(lp is None for lp in mine["logprobs"])
            continue
        assert len(mine["logprobs"]) == len(theirs["logprobs"]) == p.max_tokens
        for a, b in zip(mine["logprobs"], theirs["logprobs"]):
            assert a.top_ids == b.top_ids and len(a.top_ids) == p.num_logprobs
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


@pytest.mark.parametrize("wrong_every", [0, 3], ids=["right", "every-third-wrong"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_verified_rows_with_penalties_bias_and_masks_make_plain_steps_tokens(
    tiny_model, sampled, wrong_every
):
    """Each position of a verify step is scored as a step there would be: penalties count
    the drafts before it as made, min_tokens counts them too, a bias and a fixed mask apply
    alike; what is accepted is counted after. Drafts of plain decoding (all right, or every
    third wrong) beside a row with no penalties."""
    prompts = [[1, 2, 3, 1, 2, 3], [40, 41, 42, 43, 44], [7, 8, 7, 8], [9, 10, 11]]
    draw = dict(temperature=0.9, seed=3) if sampled else {}
    rules = [
        dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0),
        dict(logit_bias_ids=(5, 17, 30), logit_bias=(2.0, 1.5, -50.0), min_p=0.05),
        dict(min_tokens=12, stop_token_ids=(4, 6, 9), allowed_token_ids=tuple(range(3, 60))),
        {},
    ]
    params = [
        SamplingParams(max_tokens=20 + i, ignore_eos=i != 2, **draw, **r)
        for i, r in enumerate(rules)
    ]
    with _worker(tiny_model, spec=SpeculativeConfig("off")) as worker:
        plain = generate(worker, prompts, params)
    whole = [p + r["token_ids"] for p, r in zip(prompts, plain)]
    with _worker(tiny_model) as worker:
        worker.decode.verifier.drafter = _Oracle(whole, wrong_every)
        got = generate(worker, prompts, params)
        v = worker.decode.verifier
        assert v.num_steps > 2 and 0 < v.num_accepted
        assert (v.num_accepted < v.num_drafted) == bool(wrong_every)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in plain]
    assert [r["finish_reason"] for r in got] == [r["finish_reason"] for r in plain]


class _Constant:
    """A drafter that proposes the same drafts for every row at every step."""

    history = None  # it keeps no tokens on the device

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, n, seq_lens, k, width):
        return torch.tensor([self.drafts[:k]] * n, dtype=torch.int64)

    def set_row(self, row, token_ids):
        pass

    def remove_row(self, row, last):
        pass

    def append(self, n, seq_lens, tokens):
        pass

    def took(self, tokens, num_drafted_rows=None):
        pass

    def took_one(self, tokens):
        pass

    def proposed_none(self):
        pass


def _chi2_holds(draws: list[int], probs: torch.Tensor) -> bool:
    """Whether draws fit probs [V]: a chi-square over the tokens expected 10 times or more
    and one bin for the rest, below its mean plus 5 standard deviations."""
    n = len(draws)
    counts = torch.bincount(torch.tensor(draws), minlength=probs.shape[0]).double()
    expected = probs.double() * n
    big = expected >= 10
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 3, "too few bins: the test would say nothing"
    return stat < df + 5 * (2 * df) ** 0.5


def test_verified_draws_follow_the_models_distribution(tiny_model):
    """Many seeded rows at one context, each verified with the same drafts (the likeliest
    token, then another): the first token drawn follows transformers' softmax there, the
    token after an accepted draft follows it at the longer context, and each row's tokens
    are those a plain step draws with its seed (exact, not only in distribution)."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    prompt, temp = [5, 17, 99, 3, 250, 41, 8, 77, 12], 0.1

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor([ids])).logits[0, -1].float() / temp, -1)

    first = int(probs(prompt).argmax())
    p1 = probs(prompt + [first])
    likeliest = int(p1.argmax())
    p2 = probs(prompt + [first, likeliest])
    num_rows, num_seeds, bs = 8, 1200, 16
    drawn, after, plain = [], [], []
    with _worker(tiny_model, max_batch_size=num_rows, block_size=bs) as worker:
        worker.decode.verifier.drafter = _Constant([likeliest, 0])
        blocks = BlockAllocator(worker.num_kv_blocks).allocate(num_blocks_for(len(prompt) + 3, bs))
        worker.prefill([PrefillChunk(prompt, 0, blocks, SamplingParams(max_tokens=4))])
        for start in range(0, num_seeds, num_rows):
            seeds = range(start, start + num_rows)
            for k in (2, 0):  # NOTE: every row shares the prompt's blocks: each writes the
                for seed in seeds:  # same KV there (the same tokens at the same places)
                    p = SamplingParams(max_tokens=4, ignore_eos=True, temperature=temp, seed=seed)
                    worker.decode.add(
                        str(seed), first, len(prompt), blocks, p, token_ids=prompt + [first]
                    )
                rows = worker.decode.collect_many(worker.decode.launch(k))
                for seed in seeds:
                    worker.decode.remove(str(seed))
                if k:
                    drawn += [row[0] for row in rows]
                    after += [row[1] for row in rows if len(row) > 1]
                else:
                    plain += [row[0] for row in rows]
    assert drawn == plain
    assert _chi2_holds(drawn, p1)
    assert len(after) == drawn.count(likeliest) and _chi2_holds(after, p2)
