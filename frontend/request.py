"""A client's request at the frontend while it runs: its route, what it streamed,
and the tokens that belong to it (frontend/prompts.py makes it from a request)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from common.base.request import SamplingParams, TokenLogprobs
from common.wire.protocol import GenerateOutput
from frontend.detok import IncrementalDetokenizer

# A ZeroMQ client is its routing id; an in-process one (HTTP) a (kind, peer) pair, so
# the two can never share a key.
ClientKey = bytes | tuple[str, str]


class LostTokens(ValueError):
    """A node's update skips tokens: some were lost on its link (a reset); the request
    moves on from what the client has."""


@dataclass(eq=False)
class RequestState:
    node_id: str  # the id the nodes know it by
    request_id: str  # the client's id, unique within its connection
    client: ClientKey
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival_time: float  # wall clock, comparable with the nodes' stamps
    deadline: float  # monotonic
    prefill_node: str | None = None  # None while it waits here for its turn
    decode_node: str | None = None
    timings: dict = field(default_factory=dict)
    # of its prompt, from the prefill node's prefix cache (its first life)
    num_cached_tokens: int = 0
    is_prefilled: bool = False  # its first token came back (or it ended)
    early_token: int | None = None  # the first token, streamed by the prefill node
    is_decoding: bool = False  # its decode node has sent its first update
    life_base: int = 0  # output tokens the client had when this route began
    work_tokens: int = 0  # prompt tokens its prefill node was expected to compute
    route_keys: dict[int, list[int]] = field(default_factory=dict)  # block size -> its blocks' keys
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None  # monotonic
    output_ids: list[int] = field(default_factory=list)  # every token sent to the client
    prompt_logprobs: list[TokenLogprobs] | None = None
    is_prompt_only: bool = False  # max_tokens 0: its one token is made and not shown
    index: int = 0  # which of its request's n choices
    # choice 0, until sent: the other choices, which share its prefill
    forks: list = field(default_factory=list)
    is_prompt_logprobs_sent: bool = False
    # NOTE: the decode node can finish a request (max_tokens 1) before the prefill node's
    # prompt logprobs reach here (another node's link), and a fork's first token comes
    # without them (choice 0's update carries them): its nodes' updates wait.
    held: list = field(default_factory=list)  # (node, update) until they come
    held_size: int = 0  # what they hold: one an update, a token, a logprob entry, a top one
    held_since: float | None = None  # monotonic
    last_output_at: float | None = None  # monotonic
    # Moves to other nodes (a node lost or drained): how many, since when it waits to go
    # on, and the client's wait for its next token (from the last token before the move).
    num_migrations: int = 0
    moved_at: float | None = None  # monotonic; None once routed again
    moved_from: str = ""  # "decode node X (why)", for the log
    stalled_since: float | None = None  # monotonic; None once a token came after the move
    migrated_s: float = 0.0
    # what its earlier lives' nodes reported (preemptions)
    earlier_parts: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)

    def is_waiting_prompt_logprobs(self, node_name: str) -> bool:
        """Whether an update from this node waits for the prompt's logprobs: they were asked
        for and have not come. Either node's: a fork's first token from its prefill node too
        (choice 0's update carries them), so that no token streams before them, and a choice
        that moves without them moves with nothing streamed (its next prefill brings them)."""
        return (
            node_name in (self.prefill_node, self.decode_node)
            and self.params.num_prompt_logprobs >= 0
            and self.prompt_logprobs is None
        )

    def is_held_full(self, size: int) -> bool:
        """Whether one more held update, of held_size_of size, is more than its nodes can
        send before the prompt's logprobs come; they are taken to be misbehaving. A life's
        (a move drops what was held) are at most max_tokens + 2 updates (the prefill node's
        token, the decode node's first, one a step, one of counts alone), as many tokens,
        and each token's logprob with its top ones (ids and logprobs) where asked: each
        twice over, with room."""
        num_updates = self.params.max_tokens + 2
        per_token = 3 + 2 * max(self.params.num_logprobs, 0)
        return len(self.held) >= 2 * num_updates or self.held_size + size > (
            2 * num_updates * per_token
        )

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def num_known(
        self, node_name: str, index: int, token_ids: list[int], finish_reason: str | None
    ) -> int | None:
        """Of a node's update (its first token at `index` of this route's tokens), how many
        leading tokens the client has already (the rest are new); None for an update to
        drop. LostTokens: the update starts past what arrived. ValueError: the decode node
        began with another token than the prefill node."""
        num_have = len(self.output_ids) - self.life_base
        if node_name != self.decode_node:
            # The prefill node's first token, streamed while its KV travels. The decode
            # node's first update repeats it; if that came first, this one is late.
            if num_have or self.is_decoding or index or len(token_ids) != 1 or finish_reason:
                return None
            self.early_token = token_ids[0]
            return 0
        if index > num_have:
            raise LostTokens(
                f"decode node {node_name} sent token {index} of this request while "
                f"{num_have} arrived: tokens were lost on its link"
            )
        num_known = num_have - index  # the prefill node's first token, repeated
        if num_known > len(token_ids):
            return None  # a repeat of what arrived
        if token_ids[:num_known] != self.output_ids[self.life_base + index :]:
            raise ValueError(
                f"decode node {node_name} began with another first token than the prefill node"
            )
        self.is_decoding = True
        return num_known

    def take_prompt_logprobs(self) -> dict:
        """The prompt's logprobs and ids, once: they go with the first output after them
        (as GenerateOutput's fields)."""
        if self.prompt_logprobs is None or self.is_prompt_logprobs_sent:
            return {}
        self.is_prompt_logprobs_sent = True
        return {"prompt_logprobs": self.prompt_logprobs, "prompt_token_ids": self.prompt_ids}

    def final_output(
        self, reason: str, error: str | None, token_ids: list[int], logprobs: list | None
    ) -> GenerateOutput:
        """Its last message to the client: the text held back until now, its usage, and
        where its time went (with its moves, if it moved)."""
        self.timings["total_ms"] = round((time.time() - self.arrival_time) * 1e3, 3)
        if self.num_migrations:
            self.timings["num_migrations"] = self.num_migrations
            self.timings["migrated_ms"] = round(self.migrated_s * 1e3, 3)
        usage = {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": self.num_tokens,
            "cached_tokens": self.num_cached_tokens,
        }
        return GenerateOutput(
            self.request_id,
            list(token_ids),
            self.detok.take(True),
            True,
            reason,
            error,
            usage,
            self.timings,
            logprobs,
            **self.take_prompt_logprobs(),
            index=self.index,
        )

    def add_output(
        self, token_ids: list[int], logprobs: list[TokenLogprobs] | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Tokens on their way to the client (a moved request's wait ends with the first).
        Returns those kept, and their logprobs where the request asked (one each, None
        where an update lacked them): a stop string ends them at the token that completed
        it, as it would have one token a step (a verify step's update carries several).
        NOTE: the logprobs are not kept here: the client has them once they are sent."""
        token_ids = token_ids[: self.detok.add(token_ids)]
        self.output_ids += token_ids
        if self.params.num_logprobs >= 0:
            kept = list(logprobs or [])[: len(token_ids)]
            logprobs = kept + [None] * (len(token_ids) - len(kept))
        else:
            logprobs = None
        if token_ids:
            now = time.monotonic()
            if self.stalled_since is not None:
                self.migrated_s += now - self.stalled_since
                self.stalled_since = None
            self.last_output_at = now
        return token_ids, logprobs

    def continuation(self) -> tuple[list[int], SamplingParams]:
        """What its next prefill computes: the prompt and every token streamed so far,
        for the tokens still to come. Sampling is seeded by position, so the tokens that
        follow are the ones an undisturbed run gives."""
        if not self.output_ids:
            return self.prompt_ids, self.params
        # NOTE: penalties count the outputs as outputs, and the prompt's logprobs came already
        # (no token streams before them: is_waiting_prompt_logprobs).
        return self.prompt_ids + self.output_ids, dataclasses.replace(
            self.params,
            max_tokens=self.params.max_tokens - len(self.output_ids),
            num_prior_outputs=len(self.output_ids),
            num_prompt_logprobs=-1,
        )

    @staticmethod
    def held_size_of(u) -> int:
        """An update's weight in held_size (a TokenUpdate): one, a token one, each logprob
        entry one and its top ids and logprobs one each, of its tokens' and of the prompt's
        (NOTE: the two top lists apart: the wire does not hold them to one length)."""
        size = 1 + len(u.token_ids)
        for entries in (u.logprobs, u.prompt_logprobs):
            size += sum(1 + len(e.top_ids) + len(e.top_logprobs) for e in entries or ())
        return size

    def take_held(self) -> list:
        """The (node, update) pairs that waited for the prompt's logprobs; none wait after."""
        held = self.held
        self.held = []
        self.held_size = 0
        self.held_since = None
        return held

    def move(self, node_id: str, moved_from: str) -> None:
        """Forget its route: it waits to be routed again under a new id (what its old
        nodes still say under the old one is dropped)."""
        self.node_id = node_id
        self.moved_from = moved_from
        self.take_held()  # what its old decode node sent is dropped
        self.prefill_node = None
        self.decode_node = None
        self.is_prefilled = False
        self.is_decoding = False
        self.early_token = None
        self.life_base = len(self.output_ids)
        self.work_tokens = 0
        self.route_keys = {}
        self.num_migrations += 1
        self.moved_at = time.monotonic()
        if self.stalled_since is None:
            self.stalled_since = self.last_output_at or self.submitted_at
