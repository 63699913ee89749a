"""This process as the prefill side of a KV handoff, for the transfer benchmark: reserve,
write, commit through the same transfer interface a prefill node uses, against a real
decode node."""

from __future__ import annotations

import time

import torch

from common import transfer
from common.base.request import SamplingParams
from common.wire.protocol import (
    HandoffAck,
    KVCommit,
    KVHello,
    KVReserve,
    KVReserved,
    KVWelcome,
)
from launch.bench.node_under_test import NodeUnderTest

LEASE_S = 30.0  # the decode node's reservation lease


class PrefillSide:
    """This process standing in for a prefill node on one decode node's KV link."""

    def __init__(
        self, node: NodeUnderTest, cache: torch.Tensor, backend: str, is_verifying: bool = False
    ):
        self.node, self.cache, self.is_verifying = node, cache, is_verifying
        self.inbox: list = []  # KV-link messages read but not yet taken
        self.grants: dict[
            str, tuple[str, int, list[int] | None]
        ] = {}  # rid -> (grant, units, checksums)
        node.kv.send(KVHello("prefill-0"))
        welcome = self._wait(lambda m: isinstance(m, KVWelcome))
        self.writer = transfer.open_writer(
            backend, welcome, cache, lambda m: node.kv.send(m, block=False)
        )

    def _pump(self, timeout_s: float) -> None:
        self.inbox += [msg for ch, _, msg in self.node.poll(timeout_s) if ch is self.node.kv]

    def _take(self, match):
        for i, msg in enumerate(self.inbox):
            if match(msg):
                return self.inbox.pop(i)
        return None

    def _wait(self, match, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while (msg := self._take(match)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the decode node did not answer")
            self._pump(0.01)
        return msg

    def reserve(self, rid: str, prompt_len: int, max_tokens: int = 1) -> list[int]:
        while True:
            self.node.kv.send(KVReserve(rid, prompt_len, max_tokens, 1))
            r = self._wait(lambda m: isinstance(m, KVReserved) and m.request_id == rid)
            if r.block_ids is not None:
                self.grants[rid] = (r.reservation, 0, None)
                return r.block_ids
            if not r.is_retryable:
                raise RuntimeError(f"reservation refused: {r.reason}")
            time.sleep(0.01)

    def write(self, rid: str, src: list[int], dst: list[int]) -> None:
        """As a prefill node writes: with --kv-verify, the blocks' checksums taken first."""
        grant = self.grants[rid][0]
        sums = transfer.block_checksums(self.cache, src) if self.is_verifying else None
        units = self.writer.write(rid, grant, src, dst, LEASE_S)
        self.grants[rid] = (grant, units, sums)

    def commit(self, rid: str, prompt_len: int, params: SamplingParams | None = None) -> None:
        grant, units, sums = self.grants.pop(rid)
        self.node.kv.send(
            KVCommit(
                rid,
                prompt_len,
                1,
                params or SamplingParams(max_tokens=1, ignore_eos=True),
                {},
                self.writer.name,
                [1] * prompt_len,
                grant,
                units,
                None if sums is None else sums.tolist(),
            )
        )

    def wait_written(self, rids: set[str], on_written) -> None:
        while rids:
            for rid, error in self.writer.poll():
                if error:
                    raise RuntimeError(f"the write of {rid} failed: {error}")
                rids.discard(rid)
                on_written(rid)
            if rids:
                self._pump(0)  # keep the KV link moving

    def wait_acks(self, rids: set[str]) -> None:
        while rids:
            ack = self._wait(lambda m: isinstance(m, HandoffAck) and m.request_id in rids)
            if not ack.is_accepted:
                raise RuntimeError(f"commit refused: {ack.reason}")
            rids.discard(ack.request_id)
