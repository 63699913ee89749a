"""A launched decode step, as the host keeps it until its tokens are collected."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeTicket:
    """A launched decode step: whose tokens it makes and where they land on the host."""

    keys: list[str]
    slot: int
    start: object | None = None  # platform events; None where work is not queued (CPU)
    end: object | None = None
    copied: object | None = None
    num_logprobs: list[int] | None = None  # per row (-1: none), when any row asked
    # per row once collected (collect_many: a list a row, one per token made)
    logprobs: list | None = None
    num_drafts: int = 0  # k of a verify step (0: a plain step)
    busy_s: float = 0.0  # the step's time on the device, once collected
    masks_s: float = 0.0  # the host's time making its rows' step masks (before launch)
    taken_s: float = 0.0  # the host's time taking its tokens, once collected (the wait aside)
    num_accepted: list[int] | None = None  # a verify step's, per row, once collected
    num_drafted: list[int] | None = None  # a verify step's drafts, per row, once collected
