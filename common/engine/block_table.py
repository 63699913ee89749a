"""The decode batch's block tables [max_batch_size, max_blocks_per_seq] on the device,
each row's number of blocks mirrored on the host, and the entries written as sequences
cross into new blocks, sent to the device in one copy per launch at most."""

from __future__ import annotations

import numpy as np
import torch

from common.engine.h2d import HostToDevice
from common.kv.blocks import NULL_BLOCK


class BlockTable:
    def __init__(
        self,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        h2d: HostToDevice,
        is_pinned: bool,
        max_entries_per_row: int = 1,
    ):
        """max_entries_per_row: the most blocks a row may take between two launches (one a
        plain step, more where a verify step's drafts cross blocks)."""
        n, dev = max_batch_size, h2d.device
        self.block_size = block_size
        self._h2d = h2d
        self.tensor = torch.full((n, max_blocks_per_seq), NULL_BLOCK, dtype=torch.int32, device=dev)
        self.host_num_blocks = np.zeros(n, dtype=np.int32)
        self.num_block_writes = 0  # block-table entries at block crossings
        self.num_block_copies = 0  # the H2D copies that carried them (one per step at most)
        # Entries waiting for the next launch; staged in two pinned slots because one may
        # still be read by the device while the other is filled.
        self._pending: list[tuple[int, int, int]] = []
        m = n * max_entries_per_row
        self._staging = torch.zeros(2, 3, m, dtype=torch.int32, pin_memory=is_pinned)
        self._updates = torch.zeros(3, m, dtype=torch.int32, device=dev)

    @property
    def max_blocks(self) -> int:
        return self.tensor.shape[1]

    def set_row(self, row: int, block_ids: list[int]) -> None:
        """A joining sequence's blocks, written at once."""
        self._h2d.write(self.tensor[row, : len(block_ids)], block_ids)
        self.host_num_blocks[row] = len(block_ids)

    def rows_needing_block(self, host_seq_lens: np.ndarray, n: int) -> np.ndarray:
        """Rows of [0, n) whose next token falls past their last block."""
        return np.flatnonzero(host_seq_lens[:n] > self.host_num_blocks[:n] * self.block_size)

    def append(self, row: int, block_id: int) -> None:
        """The row crosses into a new block: one entry, written with the next flush."""
        col = int(self.host_num_blocks[row])
        self._pending.append((row, col, block_id))
        self.num_block_writes += 1
        self.host_num_blocks[row] = col + 1

    def flush(self, staging_slot: int | None) -> None:
        """All entries since the last flush in one copy: (row, col, block) triples,
        scattered on the device. Queued behind a running step (at launch, staging_slot
        given), they go from that pinned slot without waiting; a launch reuses a slot
        only after the step two launches back was collected, so that copy is done.
        Otherwise (between steps, None) the copy is a plain blocking one."""
        if not self._pending:
            return
        k = len(self._pending)
        triples = torch.tensor(self._pending, dtype=torch.int32).T
        if staging_slot is not None:
            staged = self._staging[staging_slot, :, :k]
            staged.copy_(triples)
            triples = staged
        dev = self._updates[:, :k]
        self._h2d.write(dev, triples)
        self.num_block_copies += 1
        self.tensor.index_put_((dev[0].long(), dev[1].long()), dev[2])
        self._pending.clear()

    def move_row(self, row: int, src: int) -> None:
        """Row src's blocks into row (a leaving row is filled by the last live one)."""
        self.tensor[row].copy_(self.tensor[src])
        self.host_num_blocks[row] = self.host_num_blocks[src]

    def reset_row(self, row: int) -> None:
        """No blocks: the null block throughout."""
        self.tensor[row].fill_(NULL_BLOCK)
        self.host_num_blocks[row] = 0
