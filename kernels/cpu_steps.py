"""The CPU decode step's bookkeeping in C (cpu_rows.c), one call each where torch would
take several small ops (each ~5 us of dispatch, a tenth of a tiny model's step): the
slot of each row's current token, the advance after sampling, and prompt lookup's drafts
(~40 torch ops, a third of a tiny model's verify step). Served by kernels/cpu.py;
kernels/portable.py is the reference they are tested against."""

from __future__ import annotations

import torch

from kernels import options, portable
from kernels.cpu_build import load

_ELEMENTWISE = load(options.current[0].build_dir).elementwise


def compute_slot_mapping(seq_lens, block_tables, block_size, out):
    """As portable.compute_slot_mapping, in one pass."""
    if not (
        seq_lens.dtype == torch.int32
        and seq_lens.is_contiguous()
        and out.dtype == torch.int64
        and out.is_contiguous()
        and block_tables.dtype == torch.int32
        and block_tables.stride(-1) == 1
        and seq_lens.device.type == "cpu"
    ):
        return portable.compute_slot_mapping(seq_lens, block_tables, block_size, out)
    _ELEMENTWISE["slot_mapping"](
        seq_lens.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        block_size,
        out.data_ptr(),
        seq_lens.shape[0],
    )


def advance_step(input_ids, sampled, seq_lens, step_inc, history=None):
    """As portable.advance_step, in one pass (a position past history's width skipped)."""
    b = input_ids.shape[0]
    is_history_ok = history is None or (
        history.dtype == torch.int32
        and history.stride(1) == 1
        and history.device.type == "cpu"
        and history.shape[0] >= b
    )
    # NOTE: every length checked, as torch's ops would: the C loop trusts them
    if not (
        is_history_ok
        and sampled.shape[0] == seq_lens.shape[0] == step_inc.shape[0] == b
        and input_ids.dtype == sampled.dtype == torch.int64
        and seq_lens.dtype == step_inc.dtype == torch.int32
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (input_ids, sampled))
        and seq_lens.is_contiguous()
        and step_inc.is_contiguous()
    ):
        return portable.advance_step(input_ids, sampled, seq_lens, step_inc, history)
    _ELEMENTWISE["advance_step"](
        input_ids.data_ptr(),
        sampled.data_ptr(),
        seq_lens.data_ptr(),
        step_inc.data_ptr(),
        None if history is None else history.data_ptr(),
        0 if history is None else history.stride(0),
        0 if history is None else history.shape[1],
        b,
    )


def prompt_lookup(tokens, seq_lens, k, min_n, max_n, width):
    """As portable.prompt_lookup, a row at a time in C (a row's lookup stops at its
    latest match)."""
    n = seq_lens.shape[0]
    width = min(width, tokens.shape[1])
    if not (
        tokens.dtype == seq_lens.dtype == torch.int32
        and tokens.stride(1) == 1
        and seq_lens.is_contiguous()
        and tokens.device.type == seq_lens.device.type == "cpu"
        and tokens.shape[0] >= n
        and 0 < width
    ):
        return portable.prompt_lookup(tokens, seq_lens, k, min_n, max_n, width)
    drafts = torch.empty(n, k, dtype=torch.int64)
    _ELEMENTWISE["prompt_lookup"](
        tokens.data_ptr(),
        tokens.stride(0),
        width,
        seq_lens.data_ptr(),
        n,
        k,
        min_n,
        max_n,
        drafts.data_ptr(),
    )
    return drafts
