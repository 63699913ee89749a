"""What a node's prefix cache holds, told to the frontend, which routes a prompt to where
its prefix is cached (frontend/router.py): the route keys added and evicted since the
last turn, or all of them after each registration, a reset link, a message the socket
could not take, and every PREFIX_RESYNC_S (which heals any drift: a node declared dead
and back, a lost update). Prefill nodes and decode nodes alike."""

from __future__ import annotations

import os
import time

from common.wire.protocol import PrefixUpdate

MAX_PREFIX_KEYS = 65536  # per PrefixUpdate (the protocol's limit); a full resync sends the newest
PREFIX_RESYNC_S = 30.0


class PrefixReport:
    """cache: a common/kv/prefix.PrefixCache; runtime: the node's NodeRuntime."""

    def __init__(self, name: str, cache, runtime, is_enabled: bool):
        self.name = name
        self.cache = cache
        self.runtime = runtime
        self.is_enabled = is_enabled
        self.is_synced = False
        self.synced_at = 0.0
        self.num_link_resets = 0

    def turn(self) -> None:
        rt = self.runtime
        if rt.num_link_resets != self.num_link_resets:  # updates may be lost: all of it again
            self.num_link_resets = rt.num_link_resets
            self.is_synced = False
        if not self.is_enabled or not rt.is_registered:
            self.is_synced = False
            self.cache.take_updates()  # a full resync follows registration
            return
        added, removed = self.cache.take_updates()
        now = time.monotonic()
        if (
            not self.is_synced
            or max(len(added), len(removed)) > MAX_PREFIX_KEYS
            or now - self.synced_at > PREFIX_RESYNC_S
        ):
            self.synced_at = now
            update = PrefixUpdate(
                self.name, os.getpid(), self.cache.snapshot()[-MAX_PREFIX_KEYS:], [], True
            )
        elif added or removed:
            update = PrefixUpdate(self.name, os.getpid(), added, removed)
        else:
            return
        # NOTE: if the socket cannot take it now, resynchronize in full next turn.
        self.is_synced = rt.frontend.send(update, block=False)
