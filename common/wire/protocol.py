"""The wire protocol: every message pdserve sends, grouped by link, and what each
link may carry. The messages live in client.py, node.py and kv.py; the codec in
codec.py. Code that sends or receives imports from here.
"""

from __future__ import annotations

from common.wire import codec
from common.wire.client import (
    AbortRequest,
    DrainReply,
    DrainRequest,
    ErrorReply,
    GenerateOutput,
    GenerateRequest,
    OutputBatch,
    StatsReply,
    StatsRequest,
    Structured,
)
from common.wire.codec import PROTOCOL_VERSION, ProtocolError, dtype_name, encode
from common.wire.kv import (
    HandoffAck,
    KVCommit,
    KVHello,
    KVRelease,
    KVReserve,
    KVReserved,
    KVTransfer,
    KVWelcome,
)
from common.wire.node import (
    Drain,
    Fork,
    Heartbeat,
    NodeAbort,
    NodeDraining,
    NodeReady,
    NodeSync,
    NodeSynced,
    PeerLost,
    PrefillRequest,
    PrefixUpdate,
    ReadyReply,
    RequestFailed,
    Shutdown,
    TokenBatch,
    TokenUpdate,
    ttft_parts,
)

# What senders and receivers import from here, by link.
__all__ = [
    # client <-> frontend (client.py)
    "AbortRequest",
    "DrainReply",
    "DrainRequest",
    "ErrorReply",
    "GenerateOutput",
    "GenerateRequest",
    "OutputBatch",
    "StatsReply",
    "StatsRequest",
    "Structured",
    # frontend <-> node (node.py)
    "Drain",
    "Fork",
    "Heartbeat",
    "NodeAbort",
    "NodeDraining",
    "NodeReady",
    "NodeSync",
    "NodeSynced",
    "PeerLost",
    "PrefillRequest",
    "PrefixUpdate",
    "ReadyReply",
    "RequestFailed",
    "Shutdown",
    "TokenBatch",
    "TokenUpdate",
    "ttft_parts",
    # prefill node <-> decode node (kv.py)
    "HandoffAck",
    "KVCommit",
    "KVHello",
    "KVRelease",
    "KVReserve",
    "KVReserved",
    "KVTransfer",
    "KVWelcome",
    # the codec (codec.py)
    "PROTOCOL_VERSION",
    "ProtocolError",
    "dtype_name",
    "encode",
    "decode",
    "decode_from",
    # what each link carries (below)
    "MESSAGES",
    "CLIENT_TO_FRONTEND",
    "FRONTEND_TO_CLIENT",
    "FRONTEND_TO_NODE",
    "FRONTEND_TO_HEARTBEAT",
    "NODE_TO_FRONTEND",
    "PREFILL_TO_DECODE",
    "DECODE_TO_PREFILL",
]

MESSAGES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (
        GenerateRequest,
        AbortRequest,
        StatsRequest,
        DrainRequest,
        GenerateOutput,
        OutputBatch,
        StatsReply,
        DrainReply,
        ErrorReply,
        PrefillRequest,
        NodeAbort,
        NodeSync,
        PeerLost,
        Shutdown,
        Drain,
        ReadyReply,
        NodeReady,
        Heartbeat,
        RequestFailed,
        NodeSynced,
        NodeDraining,
        TokenBatch,
        PrefixUpdate,
        KVHello,
        KVWelcome,
        KVReserve,
        KVReserved,
        KVTransfer,
        KVCommit,
        KVRelease,
        HandoffAck,
    )
}

# What each link carries, per direction.
CLIENT_TO_FRONTEND = (GenerateRequest, AbortRequest, StatsRequest, DrainRequest)
FRONTEND_TO_CLIENT = (GenerateOutput, OutputBatch, StatsReply, DrainReply, ErrorReply)
FRONTEND_TO_NODE = (PrefillRequest, NodeAbort, NodeSync, PeerLost, Shutdown, Drain, ReadyReply)
FRONTEND_TO_HEARTBEAT = (ReadyReply,)
NODE_TO_FRONTEND = (
    NodeReady,
    Heartbeat,
    RequestFailed,
    NodeSynced,
    NodeDraining,
    TokenBatch,
    PrefixUpdate,
)
PREFILL_TO_DECODE = (KVHello, KVReserve, KVTransfer, KVCommit, KVRelease)
DECODE_TO_PREFILL = (KVWelcome, KVReserved, HandoffAck)


def decode(frames: list, allowed: tuple[type, ...] | None = None):
    """Frames -> a message of one of the allowed types (any message when None).
    Raises ProtocolError for anything malformed, and nothing else."""
    return codec.decode(frames, MESSAGES, allowed)


def decode_from(
    frames: list, allowed: tuple[type, ...] | None = None, max_list_len: int = codec.MAX_LIST_LEN
) -> tuple[object, str | None]:
    """Frames -> (a message, who it says sent it: its "from" tag, or None)."""
    return codec.decode_from(frames, MESSAGES, allowed, max_list_len)
