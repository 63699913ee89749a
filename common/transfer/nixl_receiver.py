"""nixl's decode side (the backend is common/transfer/nixl.py): the registered cache, and
which announced writes have landed, told by the notification each write's last part
carries."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from common.base.log import Throttle, get_logger
from common.transfer.backend import LocalCache, parse
from common.transfer.copy import TransferError
from common.wire.limits import Name
from common.wire.protocol import KVTransfer

log = get_logger("transfer")
MAX_EARLY = 4096  # notifications kept for writes not yet announced (they race the KV link)


@dataclass
class NixlHeader:
    """A write to a reservation is on its way from this agent; its notification follows it."""

    agent: Name


class NixlReceiver:
    """Decode side: the registered cache, and which announced writes have landed."""

    def __init__(self, cache: LocalCache, agent, regs, device_id: int):
        """agent: a NIXL agent with the cache registered (regs), on device_id."""
        self.cache = cache.tensor
        self.agent, self._regs, self.device_id = agent, regs, device_id
        self.metadata = self.agent.get_agent_metadata()
        self._expected: dict[str, tuple[bytes, str]] = {}  # request -> (KV-link peer, its agent)
        self._landed: set[str] = set()
        self._early: OrderedDict[tuple[str, str], None] = OrderedDict()  # (agent, request) notified
        # NOTE: progress() runs every turn of the decode node's loop: a broken agent must not
        # become a log line per turn.
        self._warnings = Throttle(log)

    def describe(self) -> dict:
        return {
            "agent": self.agent.name,
            "metadata": self.metadata,
            "address": self.cache.data_ptr(),
            "device_id": self.device_id,
        }

    def receive(self, sender: bytes, msg: KVTransfer, dst_block_ids: list[int]) -> None:
        agent = parse(NixlHeader, msg.header, "nixl header").agent
        if msg.request_id in self._expected:
            raise TransferError(f"a second NIXL write announced for {msg.request_id}")
        self._expected[msg.request_id] = (sender, agent)
        if (agent, msg.request_id) in self._early:  # its notification came first
            del self._early[(agent, msg.request_id)]
            self._landed.add(msg.request_id)

    def progress(self) -> bool:
        try:
            notifs = self.agent.get_new_notifs()  # also moves UCX's connections and receives along
        except Exception as e:
            self._warnings.log(logging.WARNING, "reading NIXL notifications: %s", e)
            notifs = {}
        for agent, messages in notifs.items():
            for m in messages:
                rid = bytes(m).decode("utf-8", "replace")
                if self._expected.get(rid, (None, None))[1] == agent:
                    self._landed.add(rid)
                else:  # before its announcement, or nobody's: kept a while, bounded
                    self._early[(agent, rid)] = None
                    while len(self._early) > MAX_EARLY:
                        self._early.popitem(last=False)
        return bool(self._expected.keys() - self._landed)

    def is_landed(self, request_id: str) -> bool:
        if request_id not in self._expected:
            return True
        if request_id not in self._landed:
            self.progress()
        return request_id in self._landed  # NOTE: kept (counted) until forget()

    def landing_error(self, request_id: str) -> str | None:
        return None

    def is_lossy(self, request_id: str) -> bool:
        return False  # the prefill node writes its own pages

    def num_units(self, num_blocks: int) -> int:
        return 1

    def num_received(self, request_id: str) -> int:
        return int(request_id in self._expected)

    def forget(self, request_id: str) -> None:
        # NOTE: a write announced but not landed is stopped by its writer before the
        # reservation can end (common/transfer/nixl.py: NixlWriter._reset); see that module's NOTE.
        self._expected.pop(request_id, None)
        self._landed.discard(request_id)

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self._regs)
        except Exception as e:
            log.debug("closing a NIXL agent: %s", e)
        self._expected.clear()
        self.agent = None
