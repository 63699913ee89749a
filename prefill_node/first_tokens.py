"""A prompt's first tokens on the prefill node: the updates the node streams to the
frontend itself while the prompt's KV is on its way to the decode node."""

from __future__ import annotations

from common.base.request import stop_reason
from common.engine.prefill_job import PrefillJob
from common.wire.protocol import TokenUpdate, ttft_parts


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
