"""Suffix decoding on the host: a row's last tokens are looked up among every token this
node has seen, its running requests' and those of up to max_cached finished ones (the
least recently finished dropped first), and the tokens that followed the latest place
they occurred are its drafts (where that place is the row's own, repeated past its end).

The index maps the last m tokens before a position (m of MATCH_LENGTHS, up to the depth
less the drafts) to the latest (source, position) where they occurred with a token after
them (sources in the order they joined); a lookup tries the longest m first. A source's
last MAX_INDEXED tokens are indexed (older windows leave as it grows; a long prompt's start
is prompt lookup's), as its row proposes, at most INDEX_BUDGET windows a step in all: a row
that joins long or comes back after many plain steps is caught up over steps, and no step
stalls the loop. A finished source is indexed by the steps that propose after it (newest
first), not as it finishes: where fewer than TAKEN_SHARE of the last verify step's rows
with drafts took one, or the last proposal had none (drafts that miss, probed now and then;
a few rows of a large batch match by chance) only LEAN_BUDGET windows of them a step, so a
load whose drafts never match does not pay to index every output (the oldest leave
unindexed, for nothing); where drafts are taken, up to FINISHED_BUDGET. A plain step's
tokens wait apart (took_one) until the rows change, propose or take a verify step's tokens,
or MAX_PENDING steps have waited. NOTE: the index costs ~0.5 KB of host memory a token: the
finished sources kept are bounded by their indexed tokens (MAX_CACHED_TOKENS) as well as by
count, and keep those tokens alone. The index holds ints alone (a window's hash, a place
packed in one), which the garbage collector never tracks. The drafts are at most as many as
the match is long (a short match is weak evidence) and go to the device in one counted copy
a step: this method's steps copy to the device, prompt lookup's do not.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from common.engine.h2d import HostToDevice

MATCH_LENGTHS = (1, 2, 4, 8, 16, 32)
MAX_INDEXED = 1024  # a source's last tokens indexed
INDEX_BUDGET = 4096  # windows indexed a step, all rows together (a few ms on a CPU)
FINISHED_BUDGET = INDEX_BUDGET // 2  # of them, finished sources' where drafts are taken
LEAN_BUDGET = 64  # finished sources' windows a step where the last verify step took few
TAKEN_SHARE = 0.25  # of a verify step's rows with drafts, taking one: taken (else: lean)
MAX_CACHED_TOKENS = 1 << 17  # finished sources' indexed tokens kept, all told (~65 MB)
MAX_PENDING = 256  # plain steps' tokens held before they join their sources
END_BITS = 32  # a place in the index: its source's id << END_BITS | its end
END_MASK = (1 << END_BITS) - 1


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
        # a window's hash -> the latest place it ends (source id << END_BITS | end). NOTE:
        # ints, not tuples: the tuples a probe placed by the thousand set off collections
        # inside it (at batch 32 on the tiny model, 58 collections, 37 ms, in two probes of
        # 24 and 29 ms; none, in probes of 16 and 19 ms, with ints); a hash two windows
        # share costs a draft that misses, never a wrong token (drafts are verified)
        self._index: dict[int, int] = {}
        self._finished: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._unindexed: OrderedDict[int, None] = OrderedDict()  # finished, windows to go
        self._is_taken = True  # TAKEN_SHARE of the last verify step's drafted rows took one
        self._has_proposed = False
        # plain steps' tokens [MAX_PENDING, max_rows], rows in order, not yet in their
        # sources (flush). NOTE: an array, not a list a step: lists held up to MAX_PENDING
        # steps outlived the young generation, and the collections of the older ones that
        # followed ran inside steps the draft chooser times (at batch 1 on a tiny model it
        # then verified where verifying did not pay)
        self._pending = np.zeros((MAX_PENDING, max_rows), dtype=np.int64)
        self._num_pending = 0
        self._num_pending_rows = 0
        self._row_source: list[int | None] = [None] * max_rows
        self._next_id = 0
        self._budget = INDEX_BUDGET  # windows left to index this step
        self._staging = torch.full((max_rows, max_k), -1, dtype=torch.int64, pin_memory=is_pinned)
        self._drafts = torch.full((max_rows, max_k), -1, dtype=torch.int64, device=h2d.device)
        self.history = None  # the host's tokens are what it indexes (took)

    @property
    def num_cached(self) -> int:
        return len(self._finished)

    def set_row(self, row: int, token_ids: list[int]) -> None:
        self._flush()
        self._row_source[row] = sid = self._next_id
        self._next_id += 1
        self._sources[sid] = list(token_ids)
        self._base[sid] = 0
        start = max(len(token_ids) - MAX_INDEXED, 1)
        self._indexed[sid] = (start, start)  # none yet

    def remove_row(self, row: int, last: int) -> None:
        self._flush()
        sid = self._row_source[row]
        if self.max_cached:
            first, end = self._indexed[sid]
            lo = max(len(self._sources[sid]) - MAX_INDEXED, 1)
            # the tokens its windows hold and will hold (indexed by later steps), alone
            base = max(min(first if first < end else lo, lo) - MATCH_LENGTHS[-1], 0)
            self._sources[sid] = self._sources[sid][base:]
            self._base[sid] = base
            self._finished[sid] = self._unindexed[sid] = None
            # NOTE: what it holds, not what it indexed: a row that ran plain steps lags, and
            # keeps the tokens its windows still need
            self._num_cached_tokens += len(self._sources[sid])
            while len(self._finished) > self.max_cached or (
                self._num_cached_tokens > MAX_CACHED_TOKENS
            ):
                oldest = self._finished.popitem(last=False)[0]
                self._num_cached_tokens -= len(self._sources[oldest])
                self._drop(oldest)
        else:
            self._drop(sid)
        self._row_source[row] = self._row_source[last]
        self._row_source[last] = None

    def took(self, tokens: list[list[int]], num_drafted_rows: int | None = None) -> None:
        self._flush()
        if self._has_proposed:  # a verify step: whether enough of its drafted rows took one
            # NOTE: not any row: at batch 32 on the tiny model 8, 3, 1 and 5 rows of four
            # probes took a draft by chance, and each probe after one indexed FINISHED_BUDGET
            # windows; of the rows with drafts, not all (a row without has none to take)
            num_taken = sum(len(made) > 1 for made in tokens)
            num_drafted = len(tokens) if num_drafted_rows is None else num_drafted_rows
            self._is_taken = num_taken >= TAKEN_SHARE * max(num_drafted, 1)
            self._has_proposed = False
        for row, made in enumerate(tokens):
            self._sources[self._row_source[row]].extend(made)

    def proposed_none(self) -> None:
        # NOTE: else the last verify step's _is_taken stays, and a load whose drafts stopped
        # matching indexes FINISHED_BUDGET finished windows at each try, not LEAN_BUDGET
        self._is_taken = self._has_proposed = False

    def took_one(self, tokens: list[int]) -> None:
        # NOTE: a row's tokens join its source by one extend a flush, not one a step
        if self._num_pending and len(tokens) != self._num_pending_rows:
            self._flush()  # held steps share their rows (a row change flushes first)
        self._pending[self._num_pending, : len(tokens)] = tokens
        self._num_pending += 1
        self._num_pending_rows = len(tokens)
        if self._num_pending >= len(self._pending):
            self._flush()

    def _flush(self) -> None:
        """The plain steps' tokens into their rows' sources, before the rows change or are
        read. NOTE: every pending step has the same rows (a row that joins or leaves
        flushes first)."""
        if self._num_pending:
            sources, row_source = self._sources, self._row_source
            held = self._pending[: self._num_pending, : self._num_pending_rows]
            for row, made in enumerate(held.T.tolist()):
                sources[row_source[row]].extend(made)
            self._num_pending = 0

    def append(self, n: int, seq_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        pass  # the host learns a step's tokens when it is collected (took, took_one)

    def propose(self, n: int, seq_lens: torch.Tensor, k: int, width: int) -> torch.Tensor:
        self._flush()
        self._budget = INDEX_BUDGET
        self._has_proposed = True
        self._index_finished(FINISHED_BUDGET if self._is_taken else LEAN_BUDGET)
        rows = [self._lookup(self._row_source[row], k) for row in range(n)]
        staging = self._staging[:n, :k]
        staging.copy_(torch.tensor([r + [-1] * (k - len(r)) for r in rows], dtype=torch.int64))
        self._h2d.write(self._drafts[:n, :k], staging)
        return self._drafts[:n, :k]

    def _index_finished(self, budget: int) -> None:
        """Finished sources' windows, the newest source first, up to budget of them (taken
        from the step's). NOTE: a source's from its oldest unindexed one up, as a live row's."""
        budget = min(budget, self._budget)
        left, done = budget, []
        for sid in reversed(self._unindexed):
            if left <= 0:
                break
            left = self._index_source(sid, left)
            if self._indexed[sid][1] >= self._base[sid] + len(self._sources[sid]):
                done.append(sid)
        self._budget -= budget - left
        for sid in done:
            del self._unindexed[sid]

    def _lookup(self, sid: int, k: int) -> list[int]:
        """Up to k drafts for source sid's next tokens, [] where its suffix is not found."""
        self._budget = self._index_source(sid, self._budget)
        tokens = self._sources[sid]
        for m in reversed(self.lengths):
            if m > len(tokens):
                continue
            hit = self._index.get(hash(tuple(tokens[-m:])))
            if hit is not None:
                where, end = hit >> END_BITS, hit & END_MASK
                if where == sid:  # its own: the tokens since recur every len - end of them
                    period = len(tokens) - end
                    return [tokens[end + i % period] for i in range(min(k, m))]
                end -= self._base[where]
                return self._sources[where][end : end + min(k, m)]
        return []

    def _index_source(self, sid: int, budget: int) -> int:
        """Index source sid's windows ending in its last MAX_INDEXED positions but its
        very last (each has a token after it), dropping those that fell out first; at most
        budget windows placed or dropped. -> the budget left. NOTE: the index holds exactly
        the windows ending in [first, end) (positions in the whole source: a finished one
        keeps its tokens from base, MATCH_LENGTHS[-1] below the first it will hold)."""
        tokens, (first, end), base = self._sources[sid], self._indexed[sid], self._base[sid]
        total = base + len(tokens)
        lo = max(total - MAX_INDEXED, 1)
        while first < min(end, lo) and budget > 0:
            self._unindex(sid, first)
            first, budget = first + 1, budget - 1
        if first >= end:
            first = end = max(end, lo)  # nothing left indexed: from the window's start
        if first >= lo:  # the fallen-out ones are gone: fill upward
            while end < total and budget > 0:
                self._place(sid, end)
                end, budget = end + 1, budget - 1
        self._indexed[sid] = (first, end)
        return budget

    def _place(self, sid: int, end: int) -> None:
        """Source sid's windows ending at end, each where no later place holds it."""
        index, place = self._index, sid << END_BITS | end
        tokens, at = self._sources[sid], end - self._base[sid]
        for m in self.lengths:
            if m > end:
                break
            key = hash(tuple(tokens[at - m : at]))
            held = index.get(key)
            if held is None or held < place:
                index[key] = place

    def _drop(self, sid: int) -> None:
        """A source leaves: its windows leave the index, its tokens with them."""
        first, stop = self._indexed[sid]
        for end in range(first, stop):
            self._unindex(sid, end)
        del self._sources[sid], self._indexed[sid], self._base[sid]
        self._unindexed.pop(sid, None)

    def _unindex(self, sid: int, end: int) -> None:
        """Source sid's windows ending at end leave the index where they are still this place
        (a later one, its own or another's, took the others)."""
        index, place = self._index, sid << END_BITS | end
        tokens, at = self._sources[sid], end - self._base[sid]
        for m in self.lengths:
            if m > end:
                break
            key = hash(tuple(tokens[at - m : at]))
            if index.get(key) == place:
                del index[key]
