"""A prompt's first tokens on the prefill node: the step mask the first is sampled under,
and the updates the node streams to the frontend itself while the prompt's KV is on its way
to the decode node."""

from __future__ import annotations

import torch

from common.base import grammar
from common.base.request import stop_reason
from common.engine.prefill_job import PrefillChunk, PrefillJob
from common.wire.protocol import TokenUpdate, ttft_parts


def take_grammar(job: PrefillJob, vocab_size: int, compiles: grammar.Compiles) -> None:
    """A waiting prompt's compiled grammar, and its matcher past any tokens it streamed
    before a move. GrammarError: the grammar does not compile, or following those tokens
    costs too much (said before any pass is spent on it)."""
    job.grammar, job.is_compiling = compiles.take(job.request_id), False
    outputs = job.params.split(job.token_ids)[1]
    job.matcher = grammar.matcher_for(
        job.params, outputs, vocab_size, compiles.grammars, job.grammar
    )


def first_token_mask(
    chunk: PrefillChunk, vocab_size: int, compiles: grammar.Compiles
) -> torch.Tensor:
    """The step mask of a prompt's first token ([W] int32 words), after any tokens it
    streamed before a move (its history's outputs)."""
    job = chunk.job
    matcher = job.matcher or grammar.matcher_for(
        job.params, chunk.history[1], vocab_size, compiles.grammars, job.grammar
    )
    return matcher.fill().clone()


def first_token_updates(
    job: PrefillJob,
    token: int,
    logprobs,
    stamps: dict,
    eos_ids: tuple[int, ...],
    max_model_len: int,
) -> list[TokenUpdate]:
    """The updates a finished prompt streams now: its first token, and each fork's.

    A first token that ends its request is left to the decode node, which ends it (the
    prompt's logprobs go now all the same).
    NOTE: the prompt's logprobs go once, with the request's own update (the frontend gives
    them to its other choices): n copies could pass the link's message limit, and that would
    drop the link."""
    prompt_logprobs = job.prompt_logprobs if job.params.num_prompt_logprobs >= 0 else None
    updates = []
    for rid, t, lp in [
        (job.request_id, token, logprobs),
        *((f.request_id, f.first_token, f.first_logprobs) for f in job.forks),
    ]:
        if stop_reason(job.params, t, 1, job.prompt_len, eos_ids, max_model_len) is None:
            updates.append(
                TokenUpdate(
                    rid,
                    [t],
                    None,
                    ttft_parts(stamps),
                    index=0,
                    logprobs=[lp] if lp else None,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        elif prompt_logprobs is not None:
            updates.append(TokenUpdate(rid, [], None, index=0, prompt_logprobs=prompt_logprobs))
        prompt_logprobs = None
    return updates
