"""The wire protocol: typed messages grouped by link, and their codec.

A message is frame 0, a msgpack map {"v": PROTOCOL_VERSION, "type": TYPE, ...fields},
followed by one raw frame per tensor field (KV blocks), described in the header
by "tensors": [[field, dtype, shape], ...]. Tensors never travel as msgpack lists.
decode() checks every field's type and names what is wrong.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack
import torch

from common.sampling import SamplingParams

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message that cannot be decoded; request_id is set when the header named one."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


# ---- client <-> frontend (documented in docs/protocol.md) ---------------------

@dataclass
class GenerateRequest:
    TYPE: ClassVar[str] = "generate"
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    timeout_s: float | None = None


@dataclass
class AbortRequest:
    TYPE: ClassVar[str] = "abort"
    request_id: str


@dataclass
class StatsRequest:
    TYPE: ClassVar[str] = "stats"


@dataclass
class GenerateOutput:
    TYPE: ClassVar[str] = "output"
    request_id: str
    token_ids: list[int]
    text: str
    is_finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    usage: dict | None = None
    timings: dict | None = None


@dataclass
class StatsReply:
    TYPE: ClassVar[str] = "stats_reply"
    is_ready: bool
    nodes: dict
    model: dict | None = None   # {"name", "vocab_size", "max_model_len"}


@dataclass
class ErrorReply:
    """For a message that named no request we could answer about."""
    TYPE: ClassVar[str] = "error"
    error: str
    request_id: str | None = None


# ---- frontend -> nodes --------------------------------------------------------

@dataclass
class PrefillRequest:
    TYPE: ClassVar[str] = "prefill"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    decode_node: str          # the decode node chosen for this request ...
    decode_kv_endpoint: str   # ... and where its KV link listens


@dataclass
class NodeAbort:
    TYPE: ClassVar[str] = "node_abort"
    request_id: str


@dataclass
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"


# ---- nodes -> frontend --------------------------------------------------------

@dataclass
class NodeReady:
    TYPE: ClassVar[str] = "ready"
    role: str                 # "prefill" or "decode"
    name: str
    pid: int
    device: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_endpoint: str | None = None   # a decode node's KV link
    kv_transfer: str = "auto"        # the KV transfer backend the node asked for


@dataclass
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    role: str
    name: str
    stats: dict


@dataclass
class RequestFailed:
    TYPE: ClassVar[str] = "failed"
    request_id: str
    error: str


@dataclass
class TokenUpdate:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    timings: dict | None = None   # on a request's first update: where its TTFT went


@dataclass
class TokenBatch:
    TYPE: ClassVar[str] = "tokens"
    updates: list[TokenUpdate]


# ---- prefill <-> decode (KV link) ----------------------------------------------
# A handoff is reserve -> write -> commit: the decode node reserves destination
# blocks, the prefill node's transfer backend writes its blocks into them, and
# the commit makes the request runnable on the decode node without a copy.

@dataclass
class CudaIpcHandle:
    """A CUDA allocation shared across processes (what torch's storage sharing returns)."""
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    is_event_sync_required: bool


@dataclass
class KVHello:
    """prefill -> decode, on first contact and whenever the decode node's epoch changes."""
    TYPE: ClassVar[str] = "kv_hello"
    prefill_node: str


@dataclass
class KVWelcome:
    """decode -> prefill: the decode node's cache, and how it may be written."""
    TYPE: ClassVar[str] = "kv_welcome"
    epoch: str                       # changes when the decode node restarts
    host_id: str                     # machine identity: ipc only between equal host ids
    device: str
    cache_shape: list[int]           # [layers, 2, blocks, block_size, kv_heads, head_dim]
    dtype: str
    backends: list[str]              # what this decode node accepts, best first
    shm_name: str | None = None      # ipc on CPU: the cache's shared-memory segment
    cuda_ipc: CudaIpcHandle | None = None  # ipc on CUDA


@dataclass
class KVReserve:
    TYPE: ClassVar[str] = "kv_reserve"
    request_id: str
    prompt_len: int
    max_tokens: int


@dataclass
class KVReserved:
    """decode -> prefill: block_ids for the prompt, or a refusal."""
    TYPE: ClassVar[str] = "kv_reserved"
    request_id: str
    epoch: str
    block_ids: list[int] | None = None
    is_retryable: bool = False
    reason: str | None = None


@dataclass
class KVBlocks:
    """tcp backend: layers [first_layer, first_layer + kv.shape[0]) of a reservation's blocks.
    kv [layers, 2, num_blocks, block_size, kv_heads, head_dim] travels as one raw frame."""
    TYPE: ClassVar[str] = "kv_blocks"
    request_id: str
    first_layer: int
    kv: torch.Tensor


@dataclass
class KVCommit:
    """prefill -> decode: the reserved blocks hold the prompt's KV; start decoding."""
    TYPE: ClassVar[str] = "kv_commit"
    request_id: str
    prompt_len: int
    first_token: int
    params: SamplingParams
    timings: dict
    backend: str


@dataclass
class KVRelease:
    """prefill -> decode: drop a reservation that will never be committed."""
    TYPE: ClassVar[str] = "kv_release"
    request_id: str


@dataclass
class HandoffAck:
    TYPE: ClassVar[str] = "kv_ack"
    request_id: str
    is_accepted: bool
    is_retryable: bool = False
    reason: str | None = None


MESSAGES: dict[str, type] = {cls.TYPE: cls for cls in (
    GenerateRequest, AbortRequest, StatsRequest, GenerateOutput, StatsReply, ErrorReply,
    PrefillRequest, NodeAbort, Shutdown, NodeReady, Heartbeat, RequestFailed, TokenBatch,
    KVHello, KVWelcome, KVReserve, KVReserved, KVBlocks, KVCommit, KVRelease, HandoffAck)}

# What each link carries, per direction.
CLIENT_TO_FRONTEND = (GenerateRequest, AbortRequest, StatsRequest)
FRONTEND_TO_CLIENT = (GenerateOutput, StatsReply, ErrorReply)
FRONTEND_TO_NODE = (PrefillRequest, NodeAbort, Shutdown)
NODE_TO_FRONTEND = (NodeReady, Heartbeat, RequestFailed, TokenBatch)
PREFILL_TO_DECODE = (KVHello, KVReserve, KVBlocks, KVCommit, KVRelease)
DECODE_TO_PREFILL = (KVWelcome, KVReserved, HandoffAck)

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)}


# ---- codec --------------------------------------------------------------------

def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def _tensor_fields(cls) -> tuple[str, ...]:
    return tuple(name for name, t in _hints(cls).items() if t is torch.Tensor)


def encode(msg) -> list:
    """A message -> frames (bytes header, then raw tensor buffers)."""
    tensor_names = _tensor_fields(type(msg))
    header = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    frames: list = []
    described = []
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if f.name in tensor_names:
            t = value.detach().to("cpu").contiguous()
            described.append([f.name, str(t.dtype).removeprefix("torch."), list(t.shape)])
            frames.append(t.reshape(-1).view(torch.uint8).numpy())
        else:
            header[f.name] = _to_wire(value)
    if described:
        header["tensors"] = described
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _type_name(t) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _check(value: Any, t, where: str) -> Any:
    """value as type t, or ProtocolError naming the field."""
    origin = typing.get_origin(t)
    if origin in (Union, types.UnionType):
        options = typing.get_args(t)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _check(value, option, where)
            except ProtocolError as e:
                errors.append(str(e))
        raise ProtocolError(errors[0] if errors else f"{where} must not be null")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
        item = typing.get_args(t)[0]
        items = [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(t):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be a map, got {type(value).__name__}")
        return _build(t, value, where + ".")
    if t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where} must be a number, got {type(value).__name__}")
        return float(value)
    if t is int and isinstance(value, bool):
        raise ProtocolError(f"{where} must be an integer, got bool")
    if t is Any or isinstance(value, t):
        return value
    raise ProtocolError(f"{where} must be {_type_name(t)}, got {type(value).__name__}")


def _build(cls, fields: dict, prefix: str = ""):
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(fields) - set(known)
    if unknown:
        raise ProtocolError(f"unknown field {prefix}{sorted(unknown)[0]!r} in {cls.__name__}")
    kwargs = {}
    for name, f in known.items():
        if name not in fields:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"missing field {prefix}{name!r}")
            continue
        kwargs[name] = _check(fields[name], hints[name], prefix + name)
    return cls(**kwargs)


def decode(frames: list, allowed: tuple[type, ...] | None = None):
    """Frames -> a message. Raises ProtocolError for anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed msgpack: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("a message must be a msgpack map")
    rid = header.get("request_id") if isinstance(header.get("request_id"), str) else None
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not {PROTOCOL_VERSION}", rid)
    cls = MESSAGES.get(header.get("type"))
    if cls is None or (allowed is not None and cls not in allowed):
        raise ProtocolError(f"unknown message type {header.get('type')!r}", rid)
    fields = {k: v for k, v in header.items() if k not in ("v", "type", "tensors")}
    tensor_names = _tensor_fields(cls)
    described = header.get("tensors", [])
    if len(described) != len(tensor_names) or len(frames) != 1 + len(tensor_names):
        raise ProtocolError(f"{cls.TYPE} needs {len(tensor_names)} tensor frame(s), "
                            f"got {len(frames) - 1}", rid)
    for desc, frame in zip(described, frames[1:]):
        fields[desc[0]] = _tensor_from_frame(desc, frame, rid)
    try:
        return _build(cls, fields)
    except ProtocolError as e:
        raise ProtocolError(str(e), rid) from None


def _tensor_from_frame(desc, frame, rid) -> torch.Tensor:
    try:
        name, dtype_name, shape = desc
        dtype = _DTYPES[dtype_name]
        shape = [int(s) for s in shape]
    except (ValueError, TypeError, KeyError):
        raise ProtocolError(f"bad tensor description {desc!r}", rid) from None
    buf = memoryview(getattr(frame, "buffer", frame))
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.tensor([], dtype=dtype).element_size()
    if any(s < 0 for s in shape) or buf.nbytes != numel * itemsize:
        raise ProtocolError(f"tensor {name!r} frame holds {buf.nbytes} bytes, "
                            f"shape {shape} {dtype_name} needs {numel * itemsize}", rid)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only frame memory: we only ever copy out of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
