"""The codec: a message is frame 0, a msgpack map {"v": PROTOCOL_VERSION, "type": TYPE,
...fields}, followed by one raw frame per tensor field (KV blocks), described in the
header by "tensors": [[field, dtype, shape], ...]. Tensors never travel as msgpack
lists. A node's messages also say who sends them ("from": "NAME/EPOCH", see
peers.py). decode() checks every field's type against the limits declared on it
and names what is wrong (fields.py); lengths are checked before items, so a message
of a million items costs no more than its length check.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import msgpack
import torch

from common.base.log import CONTROL_CHARS
from common.wire.fields import build, field_names, hints
from common.wire.limits import I32_MAX, ProtocolError

PROTOCOL_VERSION = 2


def dtype_name(dtype: torch.dtype) -> str:
    """How a dtype is named on the wire ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


DTYPES = {
    dtype_name(d): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.int8,
    )
}


# ---- codec --------------------------------------------------------------------


def _to_wire(value: Any) -> Any:
    names = field_names(type(value))
    if names is not None:
        return {name: _to_wire(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        # NOTE: lists are homogeneous: one of scalars (token ids) goes as it is.
        if value and (
            field_names(type(value[0])) is not None or isinstance(value[0], (list, tuple))
        ):
            return [_to_wire(v) for v in value]
        return value
    return value


@functools.lru_cache(maxsize=None)
def _tensor_fields(cls) -> tuple[str, ...]:
    return tuple(name for name, t in hints(cls).items() if t is torch.Tensor)


def encode(msg, sender: str | None = None) -> list:
    """A message -> frames (bytes header, then raw tensor buffers); sender: the "from" tag."""
    tensor_names = _tensor_fields(type(msg))
    header = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    if sender is not None:
        header["from"] = sender
    frames: list = []
    described = []
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if f.name in tensor_names:
            t = value.detach().to("cpu").contiguous()
            described.append([f.name, dtype_name(t.dtype), list(t.shape)])
            frames.append(t.reshape(-1).view(torch.uint8).numpy())
        else:
            header[f.name] = _to_wire(value)
    if described:
        header["tensors"] = described
    return [msgpack.packb(header, use_bin_type=True), *frames]


def parse(cls, fields: Any, where: str):
    """A map received inside a message (a backend's descriptor, say) -> a cls dataclass,
    checked as a message's fields are; ProtocolError names what is wrong."""
    if not isinstance(fields, dict):
        raise ProtocolError(f"{where} must be a map, got {type(fields).__name__}")
    try:
        return build(cls, fields, where + ".")
    except ProtocolError:
        raise
    except (RecursionError, ValueError, TypeError, OverflowError) as e:  # a constructor's own check
        raise ProtocolError(f"bad {where}: {type(e).__name__}") from None


MAX_DIMS = 8
MAX_LIST_LEN = 2**20  # items in any list or map of a header, unless a link says fewer
MAX_TAG_LEN = 256  # of a "from" tag


def _request_id(value) -> str | None:
    """The id an error about the message may name (it is logged: no control characters)."""
    is_id = isinstance(value, str) and 0 < len(value) <= 256 and not CONTROL_CHARS.search(value)
    return value if is_id else None


def _unpack(buf: bytes, max_list_len: int) -> dict:
    """The header map, reading no list or map longer than max_list_len."""
    limits = dict(max_array_len=max_list_len, max_map_len=max_list_len)
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, **limits)
    except Exception as e:  # msgpack raises several unrelated types
        raise _unpack_error(buf, limits, e) from None
    if not isinstance(header, dict):
        raise ProtocolError("a message must be a msgpack map")
    return header


def _unpack_error(buf: bytes, limits: dict, error: Exception) -> ProtocolError:
    """Why a header did not unpack, naming its field and request id where the fields before
    the bad one say them (read one by one, up to it: no further than the fast path went)."""
    u = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(buf), 1), **limits)
    u.feed(buf)
    rid, key = None, None
    try:
        for _ in range(u.read_map_header()):
            key = None
            key = u.unpack()
            value = u.unpack()
            if key == "request_id":
                rid = _request_id(value)
    except Exception:  # noqa: BLE001 - the same failure, now placed
        pass
    if isinstance(key, str) and "exceeds max" in str(error):
        name = key[:64] if not CONTROL_CHARS.search(key[:64]) else _short(key)
        return ProtocolError(f"{name} holds more than {limits['max_array_len']} items", rid)
    return ProtocolError(f"malformed msgpack: {type(error).__name__}", rid)


def decode(
    frames: list,
    messages: dict[str, type],
    allowed: tuple[type, ...] | None = None,
    max_list_len: int = MAX_LIST_LEN,
):
    """Frames -> a message. Raises ProtocolError for anything malformed, and nothing else."""
    return decode_from(frames, messages, allowed, max_list_len)[0]


def sender_of(frames: list) -> str | None:
    """The "from" tag of frames that did not decode, if their header says one."""
    try:
        tag = msgpack.unpackb(bytes(frames[0]), raw=False, max_array_len=16, max_map_len=64).get(
            "from"
        )
    except Exception:  # noqa: BLE001 - no tag then
        return None
    return tag if isinstance(tag, str) and 0 < len(tag) <= MAX_TAG_LEN else None


def decode_from(
    frames: list,
    messages: dict[str, type],
    allowed: tuple[type, ...] | None = None,
    max_list_len: int = MAX_LIST_LEN,
) -> tuple[object, str | None]:
    """Frames -> (a message, its "from" tag or None). ProtocolError for anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    header = _unpack(bytes(frames[0]), max_list_len)
    rid = _request_id(header.get("request_id"))
    tag = header.get("from")
    if tag is not None and not (isinstance(tag, str) and 0 < len(tag) <= MAX_TAG_LEN):
        raise ProtocolError(f"from must be a string of at most {MAX_TAG_LEN} characters", rid)
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # NOTE: 2.0 == 2 and True == 1
        raise ProtocolError(
            f"protocol version {_short(version)} is not {PROTOCOL_VERSION} (an integer)", rid
        )
    kind = header.get("type")
    cls = messages.get(kind) if isinstance(kind, str) else None
    if cls is None or (allowed is not None and cls not in allowed):
        raise ProtocolError(f"unknown message type {_short(kind)}", rid)
    fields = {k: v for k, v in header.items() if k not in ("v", "type", "tensors", "from")}
    tensor_names = _tensor_fields(cls)
    described = header.get("tensors", [])
    if (
        not isinstance(described, list)
        or len(described) != len(tensor_names)
        or len(frames) != 1 + len(tensor_names)
    ):
        raise ProtocolError(
            f"{cls.TYPE} takes {len(tensor_names)} tensor frame(s) described in "
            f"'tensors', got {len(frames) - 1} and {_short(described)}",
            rid,
        )
    for desc, frame in zip(described, frames[1:]):
        name = desc[0] if isinstance(desc, list) and desc else None
        if name not in tensor_names or name in fields:
            raise ProtocolError(f"bad tensor description {_short(desc)}", rid)
        fields[name] = _tensor_from_frame(desc, frame, rid)
    try:
        return build(cls, fields), tag
    except ProtocolError as e:
        raise ProtocolError(str(e), rid) from None
    except (RecursionError, ValueError, TypeError, OverflowError) as e:  # a constructor's own check
        raise ProtocolError(f"bad {cls.TYPE} message: {type(e).__name__}", rid) from None


def _short(value: Any) -> str:
    """A value for an error message, cut short: errors are echoed to whoever sent it."""
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _tensor_from_frame(desc, frame, rid) -> torch.Tensor:
    try:
        name, dtype_name, shape = desc
        dtype = DTYPES[dtype_name]
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= I32_MAX for s in shape
            )
        ):
            raise ValueError
    except (ValueError, TypeError, KeyError):
        raise ProtocolError(f"bad tensor description {_short(desc)}", rid) from None
    buf = memoryview(getattr(frame, "buffer", frame))
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.tensor([], dtype=dtype).element_size()
    if buf.nbytes != numel * itemsize:
        raise ProtocolError(
            f"tensor {name!r} frame holds {buf.nbytes} bytes, "
            f"shape {shape} {dtype_name} needs {numel * itemsize}",
            rid,
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only frame memory: we only ever copy out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
