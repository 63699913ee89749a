"""A prompt being prefilled, and a chunk of it as a prefill pass computes it.

PrefillJob is the one record of a request on the side that prefills it: a prefill node
(prefill_node/scheduler.py schedules it, common/handoff/ hands its KV off) or a decode node
that prefills the prompt itself (decode_node/local.py). PrefillChunk is what a pass computes
(DeviceWorker.prefill): the scheduler's choice of tokens and the worker's input and output
in one.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from common.base.request import SamplingParams, TokenLogprobs


@dataclass
class PrefillJob:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # at the frontend (wall clock)
    decode_node: str  # where its KV goes
    decode_kv_endpoint: str
    recv_time: float = field(default_factory=time.time)
    start_time: float | None = None  # at its first chunk (wall clock)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # prompt tokens whose KV is in block_ids
    num_cached_tokens: int = 0  # of those, taken from the prefix cache
    num_published: int = 0  # full blocks given to the prefix cache
    hashes: list[bytes] = field(default_factory=list)  # each full block's chained hash
    is_reserved: bool = False  # its decode node holds blocks for it (set by the handoff)
    is_peer_granting: bool = False  # its decode node granted the previous request at once
    num_reserved: int = 0  # prefilled on its decode node: further blocks promised for outputs
    prompt_logprobs: list = field(default_factory=list)  # asked for: each chunk's, in order
    forks: list = field(default_factory=list)  # n > 1: the other sequences (Fork), sampled with it
    is_compiling: bool = False  # its grammar is being compiled (beside the loop): it waits
    grammar: object = None  # its grammar, compiled
    matcher: object = None  # its grammar's matcher, past its prior outputs (PrefillGrammars.take)

    @classmethod
    def of(cls, req, recv_time: float) -> PrefillJob:
        """The job of a PrefillRequest (common/wire/node.py), received at recv_time."""
        return cls(
            req.request_id,
            list(req.prompt_token_ids),
            req.params,
            req.arrival_time,
            req.decode_node,
            req.decode_kv_endpoint,
            recv_time,
            forks=list(req.forks),
        )

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)

    @property
    def request_ids(self) -> list[str]:
        """Its own and its forks'."""
        return [self.request_id, *(f.request_id for f in self.forks)]

    def chunk(self, start: int, end: int) -> PrefillChunk:
        """Its prompt tokens [start, end) as a pass computes them: on the prompt's last
        chunk its first token (and each fork's, with the history its penalties need), and the
        logprobs of its prompt tokens if they were asked for. A step mask for the first token
        is the caller's to set (it needs the compiled grammar)."""
        is_last = end == self.prompt_len
        p = self.params
        chunk = PrefillChunk(
            self.token_ids[start:end], start, self.block_ids, p if is_last else None, job=self
        )
        if is_last:
            chunk.fork_params = [dataclasses.replace(p, seed=f.seed) for f in self.forks]
        if is_last and p.is_processing:
            chunk.history = p.split(self.token_ids)
        if p.num_prompt_logprobs >= 0:
            chunk.prompt_targets = self.token_ids[start + 1 : end + 1] + ([-1] if is_last else [])
            chunk.num_prompt_logprobs = p.num_prompt_logprobs
        return chunk

    def ttft_stamps(self, prefill_end: float) -> dict:
        """The stamps of its time to first token as far as its prefill (wall clock), and its
        prefix-cache hit, a count riding with them (common/wire/node.py's ttft_parts)."""
        return {
            "arrival": self.arrival_time,
            "prefill_recv": self.recv_time,
            "prefill_start": self.start_time,
            "prefill_end": prefill_end,
            "cached_tokens": self.num_cached_tokens,
        }


@dataclass
class PrefillChunk:
    token_ids: list[int]  # this chunk's tokens
    context_len: int  # tokens of the same prompt already in the cache
    block_ids: list[int]  # blocks covering context_len + len(token_ids)
    params: SamplingParams | None = None  # set on a prompt's last chunk: sample its first token
    history: tuple[list[int], list[int]] | None = None  # params that need it: (prompt, outputs)
    mask: torch.Tensor | None = None  # a step mask for the first token ([W] int32 words)
    prompt_targets: list[int] | None = None  # prompt logprobs asked for: each position's next token
    num_prompt_logprobs: int = -1  # (-1 past the prompt's end), and how many alternatives
    fork_params: list[SamplingParams] = field(default_factory=list)  # n > 1: n - 1 more tokens
    job: PrefillJob | None = None  # the prompt it is of (None: a bare pass, as tools run one)
    # Set by prefill(): what is reported of the first token, and of the prompt's tokens.
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    fork_tokens: list[int] = field(default_factory=list)  # one per fork_params, same logits
    fork_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    @property
    def end(self) -> int:
        """The prompt tokens in the cache once it is computed."""
        return self.context_len + len(self.token_ids)

    @property
    def is_last(self) -> bool:
        """The prompt's last chunk: the one that samples its first token."""
        return self.params is not None
