"""Suffix decoding on the host: a row's last tokens are looked up among every token this
node has seen, its running requests' and those of up to max_cached finished ones (the
least recently finished dropped first), and the tokens that followed the latest place
they occurred are its drafts (where that place is the row's own, repeated past its end).

The index maps the last m tokens before a position (m of MATCH_LENGTHS, up to the depth
less the drafts) to the latest (source, position) where they occurred with a token after
them (sources in the order they joined); a lookup tries the longest m first. A source's
last MAX_INDEXED tokens are indexed (older windows leave as it grows; a long prompt's
start is prompt lookup's), as its row proposes, and once finished with what the verify
steps' budget leaves (a load that does not verify pays nothing), at most INDEX_BUDGET
windows a step in all and WINDOWS_PER_DRAFT for each draft it verifies (~1.7 us each
here): a row that joins long or comes back after many
plain steps is caught up over steps, and no step stalls the loop. NOTE: the index costs ~1 KB
of host memory a token: the finished sources kept are bounded by their indexed tokens
(MAX_CACHED_TOKENS) as well as by count, and keep those tokens alone. The drafts are at
most as many as the match is long (a short match is weak evidence) and go to the device
in one counted copy a step: this method's steps copy to the device, prompt lookup's do
not.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from common.engine.h2d import HostToDevice

MATCH_LENGTHS = (1, 2, 4, 8, 16, 32)
MAX_INDEXED = 1024  # a source's last tokens indexed
INDEX_BUDGET = 4096  # windows indexed a step, all rows together (a few ms on a CPU)
WINDOWS_PER_DRAFT = 64  # ... and at most this many for each draft the step verifies
MAX_CACHED_TOKENS = 1 << 17  # finished sources' indexed tokens kept, all told (~130 MB)


class SuffixDrafter:
    def __init__(
        self,
        max_rows: int,
        max_k: int,
        max_depth: int,
        max_cached: int,
        h2d: HostToDevice,
        is_pinned: bool = False,
    ):
        self.lengths = [m for m in MATCH_LENGTHS if m <= max(max_depth - max_k, 1)]
        self.max_cached = max_cached
        self._h2d = h2d
        self._sources: dict[int, list[int]] = {}  # id -> tokens, live and finished
        self._indexed: dict[int, tuple[int, int]] = {}  # id -> [first, end) of ends indexed
        self._base: dict[int, int] = {}  # id -> the position of its tokens' first kept
        self._num_cached_tokens = 0
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}
        self._finished: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._pending: deque[int] = deque()  # finished sources not yet indexed whole
        self._row_source: list[int | None] = [None] * max_rows
        self._next_id = 0
        self._budget = INDEX_BUDGET  # windows left to index this step
        self._staging = torch.full((max_rows, max_k), -1, dtype=torch.int64, pin_memory=is_pinned)
        self._drafts = torch.full((max_rows, max_k), -1, dtype=torch.int64, device=h2d.device)

    @property
    def num_cached(self) -> int:
        return len(self._finished)

    def set_row(self, row: int, token_ids: list[int]) -> None:
        self._row_source[row] = sid = self._next_id
        self._next_id += 1
        self._sources[sid] = list(token_ids)
        self._base[sid] = 0
        start = max(len(token_ids) - MAX_INDEXED, 1)
        self._indexed[sid] = (start, start)  # none yet

    def remove_row(self, row: int, last: int) -> None:
        """The row's request finishes: its last MAX_INDEXED tokens stay, cached, their
        windows indexed by the verify steps to come (within their budget: a finish costs
        nothing where no step verifies)."""
        sid = self._row_source[row]
        if self.max_cached:
            tokens, (first, end) = self._sources[sid], self._indexed[sid]
            # the tokens its windows hold and will hold, alone
            lo = max(len(tokens) - MAX_INDEXED, 1)
            base = max((lo if first == end else min(first, lo)) - MATCH_LENGTHS[-1], 0)
            self._sources[sid] = tokens[base:]
            self._base[sid] = base
            self._finished[sid] = None
            self._pending.append(sid)
            self._num_cached_tokens += len(tokens) - base
            while len(self._finished) > self.max_cached or (
                self._num_cached_tokens > MAX_CACHED_TOKENS
            ):
                oldest = self._finished.popitem(last=False)[0]
                self._num_cached_tokens -= len(self._sources[oldest])
                self._drop(oldest)
            # NOTE: both in the order they finished: the dropped ones lead the pending
            while self._pending and self._pending[0] not in self._sources:
                self._pending.popleft()
        else:
            self._drop(sid)
        self._row_source[row] = self._row_source[last]
        self._row_source[last] = None

    def took(self, tokens: list[list[int]]) -> None:
        for row, made in enumerate(tokens):
            self._sources[self._row_source[row]].extend(made)

    def append(self, n: int, seq_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        pass  # the host learns a step's tokens when it is collected (took)

    def propose(self, n: int, seq_lens: torch.Tensor, k: int, width: int) -> torch.Tensor:
        # NOTE: the step's indexing grows with its drafts, as its work does: a probe of one
        # draft on a small model pays for few. Finished requests first (what the rows will
        # look up), with half the budget at most; the rows' own windows with the rest.
        budget = min(INDEX_BUDGET, WINDOWS_PER_DRAFT * k * n)
        self._budget = budget // 2
        while self._pending and self._budget > 0:
            sid = self._pending[0]
            if sid in self._sources:  # NOTE: not if dropped from the cache meanwhile
                self._budget = self._index_source(sid, self._budget)
                (first, end), length = self._indexed[sid], self._base[sid] + len(self._sources[sid])
                if end < length or first > max(length - MAX_INDEXED, 1):
                    break  # the budget ran out inside it
            self._pending.popleft()
        self._budget += budget - budget // 2
        rows = [self._lookup(self._row_source[row], k) for row in range(n)]
        staging = self._staging[:n, :k]
        staging.copy_(torch.tensor([r + [-1] * (k - len(r)) for r in rows], dtype=torch.int64))
        self._h2d.write(self._drafts[:n, :k], staging)
        return self._drafts[:n, :k]

    def _lookup(self, sid: int, k: int) -> list[int]:
        """Up to k drafts for source sid's next tokens, [] where its suffix is not found."""
        self._budget = self._index_source(sid, self._budget)
        tokens = self._sources[sid]
        for m in reversed(self.lengths):
            if m > len(tokens):
                continue
            hit = self._index.get(tuple(tokens[-m:]))
            if hit is not None:
                where, end = hit
                if where == sid:  # its own: the tokens since recur every len - end of them
                    period = len(tokens) - end
                    return [tokens[end + i % period] for i in range(min(k, m))]
                end -= self._base[where]
                return self._sources[where][end : end + min(k, m)]
        return []

    def _index_source(self, sid: int, budget: int) -> int:
        """Index source sid's windows ending in its last MAX_INDEXED positions but its very
        last (each has a token after it), dropping those that fell out first; at most
        budget windows placed or dropped. -> the budget left. NOTE: the index holds exactly
        the windows ending in [first, end); positions count from the source's start, its
        tokens from base (a finished source's: cut below what its windows need)."""
        tokens, (first, end) = self._sources[sid], self._indexed[sid]
        length = self._base[sid] + len(tokens)
        lo = max(length - MAX_INDEXED, 1)
        while first < min(end, lo) and budget > 0:
            self._unindex(sid, first)
            first, budget = first + 1, budget - 1
        is_finished = sid in self._finished
        if first >= end:
            # nothing left indexed: a live source from the window's start; a finished one
            # from its newest window down (what a request asked again looks up first)
            first = end = length if is_finished else max(end, lo)
        if first >= lo:  # the fallen-out ones are gone: fill upward
            while end < length and budget > 0:
                self._place(sid, end)
                end, budget = end + 1, budget - 1
            while is_finished and first > lo and budget > 0:  # then down to the start
                first, budget = first - 1, budget - 1
                self._place(sid, first)
        self._indexed[sid] = (first, end)
        return budget

    def _place(self, sid: int, end: int) -> None:
        """Source sid's windows ending at end, each where no later place holds it."""
        tokens, base = self._sources[sid], self._base[sid]
        for m in self.lengths:
            if m > end:
                break
            key = tuple(tokens[end - m - base : end - base])
            held = self._index.get(key)
            if held is None or held < (sid, end):
                self._index[key] = (sid, end)

    def _drop(self, sid: int) -> None:
        """A source leaves: its windows leave the index, its tokens with them."""
        first, stop = self._indexed[sid]
        for end in range(first, stop):
            self._unindex(sid, end)
        del self._sources[sid], self._indexed[sid], self._base[sid]

    def _unindex(self, sid: int, end: int) -> None:
        """Source sid's windows ending at end leave the index where they are still this place
        (a later one, its own or another's, took the others)."""
        tokens, base = self._sources[sid], self._base[sid]
        for m in self.lengths:
            if m > end:
                break
            key = tuple(tokens[end - m - base : end - base])
            if self._index.get(key) == (sid, end):
                del self._index[key]
