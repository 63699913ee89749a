"""The prefill node's grammars: each compiled beside the loop as its prompt arrives (the
prompt waits for it), its matcher brought past the tokens the request streamed before a
move, and the step mask its first token is sampled under."""

from __future__ import annotations

from typing import Callable

import torch

from common.base import grammar, grammar_matcher
from common.engine.prefill_job import PrefillChunk, PrefillJob


class PrefillGrammars:
    def __init__(self, make: Callable[[], grammar.Grammars], vocab_size: int):
        self.compiles = grammar.Compiles(make)  # make: on the first compile, on its thread
        self.vocab_size = vocab_size

    def submit(self, job: PrefillJob) -> None:
        """A job with a grammar waits for its compile (is_compiling) before it may start."""
        if job.params.grammar:
            self.compiles.submit(job.request_id, job.params.grammar)
            job.is_compiling = True

    def take_compiled(self, jobs: list[PrefillJob]) -> list[tuple[PrefillJob, ValueError]]:
        """The waiting jobs whose grammar has compiled take it and may start; those refused,
        with the GrammarError that says why: the grammar did not compile, or following the
        tokens the request streamed before a move costs too much (the request's own fault),
        or, is_retryable, this node could not compile it (its vocabulary, say)."""
        refused = []
        for job in [j for j in jobs if j.is_compiling and self.compiles.is_done(j.request_id)]:
            try:
                self.take(job)
            except ValueError as e:  # GrammarError
                refused.append((job, e))
        return refused

    def take(self, job: PrefillJob) -> None:
        """The job's compiled grammar, and its matcher past its prior outputs.
        GrammarError: the grammar does not compile, or those outputs cost too much (said
        before any pass is spent on the prompt)."""
        job.grammar, job.is_compiling = self.compiles.take(job.request_id), False
        outputs = job.params.split(job.token_ids)[1]
        job.matcher = grammar_matcher.matcher_for(
            job.params, outputs, self.vocab_size, self.compiles.grammars, job.grammar
        )

    def first_token_mask(self, chunk: PrefillChunk) -> torch.Tensor:
        """The step mask of a prompt's first token ([W] int32 words), after any tokens it
        streamed before a move (its history's outputs); a bad word of several tokens is
        matched without a grammar (no compile, no cost to refuse)."""
        job = chunk.job
        matcher = job.matcher or grammar_matcher.matcher_for(
            job.params, chunk.history[1], self.vocab_size, self.compiles.grammars, job.grammar
        )
        return matcher.fill().clone()

    def drop(self, request_id: str) -> None:
        self.compiles.drop(request_id)

    def close(self) -> None:
        self.compiles.close()
