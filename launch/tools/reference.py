"""transformers' own greedy tokens: the reference pdserve's output is checked
against, token for token (the tests and launch.tools.soak)."""

from __future__ import annotations


def hf_greedy(model_dir, prompts, max_new_tokens):
    """transformers' own greedy tokens for each prompt, one prompt at a time."""
    return [tokens for tokens, _ in hf_greedy_gaps(model_dir, prompts, max_new_tokens)]


def hf_greedy_gaps(model_dir, prompts, max_new_tokens, make_cache=None):
    """transformers' greedy tokens for each prompt, and at each step the gap between the
    two best logits; make_cache(): the cache each prompt's generation keeps (default:
    transformers' own). NOTE: where the gap is within float32 rounding (the tiny models'
    logits are about 1 in size), sums taken in another order (a batch, paged
    attention) may pick the other token: such a step has no single right answer."""
    return [
        (tokens, [float(top[0] - top[1]) for top in (lg.topk(2).values for lg in logits)])
        for tokens, logits in _greedy_logits(model_dir, prompts, max_new_tokens, make_cache)
    ]


def hf_greedy_logprobs(model_dir, prompts, max_new_tokens, make_cache=None):
    """transformers' greedy tokens' log-probabilities for each prompt (make_cache: as
    hf_greedy_gaps)."""
    import torch

    return [
        [torch.log_softmax(lg, -1)[t].item() for lg, t in zip(logits, tokens)]
        for tokens, logits in _greedy_logits(model_dir, prompts, max_new_tokens, make_cache)
    ]


def _greedy_logits(model_dir, prompts, max_new_tokens, make_cache):
    """(greedy tokens, each step's logits [vocab]) for each prompt, one at a time, fp32."""
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                past_key_values=make_cache() if make_cache else None,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out.append((gen.sequences[0, len(ids) :].tolist(), [lg[0] for lg in gen.logits]))
    return out


def clear_prompts(model_dir, candidates, max_new_tokens, count, min_gap=1e-3, make_cache=None):
    """The first count candidates whose greedy tokens are unambiguous (every step's two
    best logits at least min_gap apart), and those tokens (make_cache: as hf_greedy_gaps)."""
    chosen = [
        (ids, tokens)
        for ids, (tokens, gaps) in zip(
            candidates, hf_greedy_gaps(model_dir, candidates, max_new_tokens, make_cache)
        )
        if min(gaps) >= min_gap
    ]
    assert len(chosen) >= count, (
        f"only {len(chosen)} of {len(candidates)} candidates are unambiguous"
    )
    return [ids for ids, _ in chosen[:count]], [tokens for _, tokens in chosen[:count]]
