"""Hostile frame sequences, generated from a seed: random bytes, truncated and deeply
nested msgpack, wrong types and versions, out-of-range numbers, foreign message
types, extra or missing frames, bogus tensors, and well-formed messages with
rogue contents (readies, tokens, failures, reservations, commits, shutdowns,
aborts), so that some reach deep into the receivers' handlers."""

from __future__ import annotations

import dataclasses
import random

import msgpack

from common.wire import fields, protocol

NUMBERS = [
    0,
    1,
    2,
    3,
    -1,
    7,
    15,
    16,
    17,
    2**31 - 1,
    2**31,
    2**40,
    -(2**63),
    2**64 - 1,
    0.0,
    0.5,
    1.5,
    -1.0,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e308,
]
STRINGS = [
    "",
    "x",
    "decode-0",
    "prefill-0",
    "decode-0.heartbeat",
    "stats",
    "1",
    "2",
    "a" * 5000,
    "\x00",
    "é",
    "tcp://127.0.0.1:1",
    "cpu",
    "float32",
    "ipc",
    "tcp",
]
# NOTE: no well-formed drain_node: a local client may drain a node by design (an
# operator's command; test_migration.py checks who may), which these floods come as.
TYPES = sorted(set(protocol.MESSAGES) - {protocol.DrainRequest.TYPE}) + [
    "kv_handoff",
    "nope",
    "",
    "GENERATE",
]


def _nested(rng: random.Random, depth: int):
    return [_nested(rng, depth - 1)] if depth else rng.choice([[], {}, 1, "x"])


def _any(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.35:
        return rng.choice(NUMBERS)
    if r < 0.6:
        return rng.choice(STRINGS)
    if r < 0.7:
        return rng.choice([None, True, False, b"", b"\x00" * 9])
    if r < 0.8 and depth < 3:
        return [_any(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if r < 0.9 and depth < 3:
        return {rng.choice(STRINGS): _any(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return _nested(rng, rng.choice([5, 40, 200]))


def _plausible(rng: random.Random, name: str, hint):
    """A value that fits the field well enough to pass the type check, most of the time."""
    text = str(hint)
    if name in ("request_id",):
        return f"{rng.randint(1, 60):x}"
    if "SamplingParams" in text:
        return {
            "max_tokens": rng.choice([1, 2, 3, 2**31]),
            "temperature": rng.choice([0.0, 1.0]),
            "top_k": rng.choice([-1, 5, 2**40]),
            "seed": rng.randint(0, 9),
        }
    if name == "kv":
        return None
    if "list" in text:
        return [rng.choice([0, 1, 2, 5, 511, 2**31 - 1]) for _ in range(rng.randint(0, 6))]
    if "dict" in text:
        return {
            rng.choice(["arrival", "prefill_end", "num_running", "loop_age_s"]): rng.choice(
                NUMBERS[:9]
            )
        }
    if "bool" in text:
        return rng.random() < 0.5
    if "int" in text:
        return rng.choice([0, 1, 2, 3, 4, 16, 64, 2**31])
    if "float" in text:
        return rng.choice([0.0, 1.0, 1e9])
    if name == "role":
        return rng.choice(["prefill", "decode", "x"])
    return rng.choice(STRINGS[:8])


def message(rng: random.Random) -> list[bytes]:
    """One hostile frame sequence."""
    r = rng.random()
    if r < 0.07:
        return [rng.randbytes(rng.randint(0, 64))]
    kind = rng.choice(TYPES)
    cls = protocol.MESSAGES.get(kind)
    header: dict = {
        "v": 2 if rng.random() < 0.9 else rng.choice(NUMBERS + ["1", None]),
        "type": kind if rng.random() < 0.92 else _any(rng),
    }
    frames = []
    if cls is not None:
        hints = fields.hints(cls)
        for f in dataclasses.fields(cls):
            if rng.random() < 0.08:
                continue  # a field left out
            header[f.name] = (
                _plausible(rng, f.name, hints[f.name]) if rng.random() < 0.75 else _any(rng)
            )
            if f.name == "kv":
                del header["kv"]
                shape = [rng.choice([0, 1, 2, 16]) for _ in range(rng.choice([1, 6, 6, 6, 9]))]
                numel = 1
                for s in shape:
                    numel *= s
                header["tensors"] = [["kv", rng.choice(["float32", "bfloat16", "int8", 5]), shape]]
                frames.append(b"\x00" * (numel * 4 if rng.random() < 0.7 else rng.randint(0, 64)))
    if rng.random() < 0.1:
        header[rng.choice(["tensors", "extra", "v2"])] = _any(rng)
    if rng.random() < 0.05:
        frames.append(rng.randbytes(rng.randint(0, 32)))
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (ValueError, TypeError, OverflowError):  # nesting or ints msgpack itself refuses
        packed = msgpack.packb({"v": 2, "type": kind}, use_bin_type=True)
    if rng.random() < 0.05:
        packed = packed[: rng.randint(0, len(packed))]  # truncated
    return [packed, *frames]
