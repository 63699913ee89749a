"""Generated hostile messages through the codec alone: each one becomes a message or a
ProtocolError, never another exception (into a running cluster: tests/cluster/test_fuzz.py)."""

from __future__ import annotations

import random

from common.wire import protocol
from common.wire.protocol import ProtocolError
from tests.fuzz_messages import message


def test_decode_never_raises_anything_but_protocol_error():
    rng = random.Random(1)
    num_decoded = 0
    for _ in range(20_000):
        frames = message(rng)
        try:
            protocol.decode(frames)
            num_decoded += 1
        except ProtocolError:
            pass
    assert num_decoded > 100  # some got all the way through the checks
