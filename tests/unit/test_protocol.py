"""Every message type survives encode/decode; malformed input is named, not crashed on."""

import dataclasses

import msgpack
import pytest
import torch

from common.base.request import SamplingParams, TokenLogprobs
from common.wire import protocol as p

PARAMS = SamplingParams(
    max_tokens=8,
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    seed=5,
    stop_token_ids=(3, 4),
    ignore_eos=True,
)
# Every field set: what the full sampling path carries from the frontend to both nodes.
FULL_PARAMS = SamplingParams(
    max_tokens=8,
    temperature=0.5,
    seed=2,
    num_logprobs=3,
    num_prompt_logprobs=0,
    is_processed_logprobs=True,
    presence_penalty=0.5,
    frequency_penalty=0.25,
    repetition_penalty=1.1,
    min_p=0.05,
    min_tokens=2,
    logit_bias_ids=(3, 9),
    logit_bias=(1.5, -100.0),
    allowed_token_ids=(1, 2, 3, 9),
    bad_words_ids=((4,), (5, 6)),
    num_prior_outputs=1,
    grammar=("regex", "[a-z]+", "compact"),
)
KV = torch.randn(2, 2, 3, 4, 2, 8).to(torch.bfloat16)

EXAMPLES = [
    p.GenerateRequest("r1", prompt="hi", max_tokens=4, stop=["x"], seed=None, timeout_s=2.5),
    p.GenerateRequest("r2", prompt_token_ids=[1, 2, 3], temperature=1, top_k=5),
    p.GenerateRequest("r3", messages=[{"role": "user", "content": "yo"}]),
    p.GenerateRequest(
        "r4",
        messages=[
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            }
        ],
        max_tokens=0,
        logprobs=5,
        prompt_logprobs=0,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=2,
        logit_bias={"7": -100},
        allowed_token_ids=[1, 2],
        bad_words=["no"],
        n=3,
        structured=p.Structured("json_schema", '{"type": "object"}', "any"),
        tools='[{"type": "function"}]',
        chat_template_kwargs={"enable_thinking": False},
    ),
    p.AbortRequest("r1"),
    p.StatsRequest(),
    p.DrainRequest("decode-1"),
    p.DrainReply("decode-1", 3),
    p.DrainReply("decode-0", 0, 40, False),
    p.GenerateOutput(
        "r1", [5, 6], "ab", True, "stop", None, {"prompt_tokens": 2}, {"ttft_ms": 1.5}
    ),
    p.OutputBatch(
        [p.GenerateOutput("r1", [5], "a"), p.GenerateOutput("r2", [], "", True, "error", "no")]
    ),
    p.GenerateOutput(
        "r4",
        [5],
        "a",
        logprobs=[TokenLogprobs(-0.5, [5, 9], [-0.5, -9999.0])],
        prompt_logprobs=[TokenLogprobs(-2.0, [], [])],
        prompt_token_ids=[1, 2],
        index=2,
    ),
    p.StatsReply(
        True,
        {"decode-0": {"role": "decode"}},
        {"name": "m", "vocab_size": 512},
        {"pid": 7, "num_waiting": 0},
    ),
    p.ErrorReply("bad", None),
    p.PrefillRequest("r1", [1, 2], PARAMS, 123.5, "decode-1", "tcp://127.0.0.1:5603"),
    p.NodeAbort("r1"),
    p.NodeSync(3, ["1a", "2b.1"]),
    p.PeerLost("prefill-0", "42-ab12cd34", True),
    p.Shutdown(),
    p.Drain(),
    p.ReadyReply(True),
    p.ReadyReply(False, "a live decode node named 'decode-0' is registered", True),
    p.NodeReady(
        "decode",
        "decode-0",
        42,
        "42-ab12cd34",
        "cpu",
        100,
        16,
        1024,
        "tcp://127.0.0.1:5602",
        "ipc",
        64,
    ),
    p.Heartbeat("decode", "decode-0", {"num_running": 3}, 42, "42-ab12cd34"),
    p.RequestFailed("r1", "boom"),
    p.RequestFailed("r2", "decode node decode-1 restarted during the KV write", True),
    p.RequestFailed("r3", "the grammar costs too much to follow", is_bad_request=True),
    p.NodeSynced(3, ["1a"], ["2b.1"]),
    p.NodeDraining("decode-1", 42),
    p.PrefixUpdate("prefill-0", 42, [-5, 2**62], [7], False),
    p.TokenBatch(
        [
            p.TokenUpdate("r1", [7], None, {"queue_ms": 1.0}),
            p.TokenUpdate("r2", [8], "length", index=5),
        ]
    ),
    p.TokenBatch(
        [
            p.TokenUpdate(
                "r3",
                [7, 8],
                logprobs=[TokenLogprobs(-1.0, [7], [-1.0])] * 2,
                prompt_logprobs=[TokenLogprobs(-3.0, [4], [-0.1])],
            )
        ]
    ),
    p.KVHello("prefill-0"),
    p.KVWelcome(
        "123-ab",
        "host/boot",
        "cuda:0",
        [2, 2, 100, 16, 2, 8],
        "bfloat16",
        {
            "ipc": {
                "shm_name": None,
                "cuda": {
                    "device": 0,
                    "handle": b"\x00\x01handle",
                    "storage_size": 4096,
                    "event_handle": None,
                },
            },
            "tcp": {},
        },
    ),
    p.KVWelcome(
        "123-ab",
        "host/boot",
        "cpu",
        [2, 2, 100, 16, 2, 8],
        "float32",
        {
            "nixl": {
                "agent": "pdserve-7-ab",
                "metadata": b"\x00" * 300,
                "address": 2**47,
                "device_id": 0,
            },
            "dist": {"store": "127.0.0.1:40123"},
        },
    ),
    p.KVReserve("r1", 40, 8, 17),
    p.KVReserve("r3", 40, 8, 18, ["r3a", "r3b"]),
    p.KVReserved("r1", "123-ab", [3, 4, 5], lease_s=30.0, ask=17, reservation="a1b2c3d4e5f6"),
    p.KVReserved("r2", "123-ab", None, True, "decode queue is full (4)"),
    p.KVReserved("r3", "123-ab", None, True, "needs 3 KV blocks, 1 are free now", 30.0, True),
    p.KVTransfer("r1", "a1b2c3d4e5f6", "tcp", {"first_layer": 2}, KV),
    p.KVTransfer(
        "r1",
        "a1b2c3d4e5f6",
        "dist",
        {"group": "5f0c9a", "tag": 17},
        torch.empty(0, dtype=torch.uint8),
    ),
    p.KVCommit("r1", 40, 9, PARAMS, {"prefill_end": 1.0}, "ipc", [3] * 40),
    p.KVCommit(
        "r1", 3, 9, PARAMS, {}, "tcp", [3] * 3, "a1b2c3d4e5f6", 28, [-(2**31), 0, 2**31 - 1]
    ),
    p.KVCommit(
        "r2",
        3,
        9,
        FULL_PARAMS,
        {},
        "ipc",
        [3] * 3,
        "a1b2c3d4e5f6",
        0,
        None,
        TokenLogprobs(-0.25, [9], [-0.25]),
    ),
    p.PrefillRequest("r2", [1, 2], FULL_PARAMS, 123.5, "decode-1", "tcp://127.0.0.1:5603"),
    p.PrefillRequest(
        "r3",
        [1, 2],
        PARAMS,
        123.5,
        "decode-1",
        "tcp://127.0.0.1:5603",
        [p.Fork("r3a", 8), p.Fork("r3b", 2**63 - 1)],
    ),
    p.KVCommit(
        "r3",
        3,
        9,
        FULL_PARAMS,
        {},
        "ipc",
        [3] * 3,
        "a1b2c3d4e5f6",
        0,
        None,
        None,
        [p.Fork("r3a", 8, 11, TokenLogprobs(-0.5, [11], [-0.5])), p.Fork("r3b", 9, 0)],
    ),
    p.KVRelease("r1"),
    p.HandoffAck("r1", False, False, "no reservation"),
]
KV_EXAMPLE = next(m for m in EXAMPLES if isinstance(m, p.KVTransfer))


def _equal(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y, f.name


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(p.MESSAGES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.TYPE)
def test_round_trip(msg):
    frames = p.encode(msg)
    back = p.decode([bytes(f) for f in frames])
    assert type(back) is type(msg)
    _equal(msg, back)


def test_kv_travels_as_a_raw_frame_not_msgpack():
    frames = p.encode(KV_EXAMPLE)
    assert len(frames) == 2
    header = msgpack.unpackb(frames[0])
    assert "data" not in header and header["tensors"] == [["data", "bfloat16", list(KV.shape)]]
    assert len(bytes(frames[1])) == KV.numel() * 2
    assert len(frames[0]) < 512


def _header(**fields):
    return [msgpack.packb({"v": 2, **fields})]


@pytest.mark.parametrize(
    "frames,match",
    [
        ([b"\xc1\xff"], "malformed msgpack"),
        ([msgpack.packb([1, 2])], "msgpack map"),
        (_header(type="nope"), "unknown message type"),
        ([msgpack.packb({"v": 99, "type": "abort", "request_id": "a"})], "protocol version"),
        ([msgpack.packb({"v": 2.0, "type": "abort", "request_id": "a"})], "protocol version 2.0"),
        ([msgpack.packb({"v": "2", "type": "abort", "request_id": "a"})], "protocol version"),
        (_header(type="abort"), "missing field 'request_id'"),
        (_header(type="abort", request_id=5), "request_id must be str"),
        (
            _header(type="generate", request_id="a", max_tokens="many"),
            "max_tokens must be an integer",
        ),
        (
            _header(type="generate", request_id="a", max_tokens=True),
            "max_tokens must be an integer",
        ),
        (
            _header(type="generate", request_id="a", prompt_token_ids=[1, "x"]),
            r"prompt_token_ids\[1\]",
        ),
        (_header(type="generate", request_id="a", colour="blue"), "unknown field 'colour'"),
        (
            _header(
                type="prefill",
                request_id="a",
                prompt_token_ids=[1],
                arrival_time=0.0,
                params={"max_tokens": "x"},
                decode_node="d",
                decode_kv_endpoint="tcp://x:1",
            ),
            "params.max_tokens",
        ),
        (
            _header(
                type="kv_transfer",
                request_id="a",
                backend="tcp",
                header={},
                tensors=[["data", "float32", [4]]],
            ),
            "tensor frame",
        ),
        (
            _header(
                type="kv_welcome",
                epoch="e",
                host_id="h",
                device="cpu",
                cache_shape=[1],
                dtype="x",
                backends=["ipc"],
            ),
            "backends must be a map",
        ),
        # A backend's descriptor is plain data, bytes bounded: its backend checks the fields.
        (
            _header(
                type="kv_welcome",
                epoch="e",
                host_id="h",
                device="cpu",
                cache_shape=[1],
                dtype="x",
                backends={"nixl": {"metadata": b"x" * (64 * 2**10 + 1)}},
            ),
            "longer than 65536 bytes",
        ),
        (
            _header(
                type="kv_welcome",
                epoch="e",
                host_id="h",
                device="cpu",
                cache_shape=[1],
                dtype="x",
                backends={"ipc": {"a": {"b": {"c": 1}}}},
            ),
            "too large or too deeply nested",
        ),
        (
            _header(
                type="kv_transfer",
                request_id="a",
                reservation="g",
                backend="tcp",
                header={"x": {"y": {"z": 1}}},
                tensors=[["data", "uint8", [0]]],
            )
            + [b""],
            "too large or too deeply nested",
        ),
        (_header(type="stats_reply", is_ready=True, nodes={"n": {"a": b"1"}}), "holds a bytes"),
        # A stats reply holds each node's figures one level down: one level more, no further.
        (
            _header(type="stats_reply", is_ready=True, nodes={"n": {"a": {"b": {"c": {"d": 1}}}}}),
            "too large or too deeply nested",
        ),
        (
            _header(
                type="heartbeat", role="prefill", name="n", stats={"a": {"b": {"c": {"d": 1}}}}
            ),
            "too large or too deeply nested",
        ),
    ],
)
def test_malformed_is_named(frames, match):
    with pytest.raises(p.ProtocolError, match=match):
        p.decode(frames)


def test_chat_messages_are_bounded_in_all_not_only_level_by_level():
    """Lists nested within each level's limits (4 deep, 63 wide: 15.75 million items in one
    message of 16 MiB) cost the frontend's loop seconds to walk: their items are counted
    first, and the count stops once past the limit, never reading the rest."""
    from common.wire.client import MAX_MESSAGE_ITEMS, MAX_MESSAGES

    def generate(messages):
        return [
            msgpack.packb({"v": 2, "type": "generate", "request_id": "a", "messages": messages})
        ]

    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 2
    turns = [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": [{"type": "text", "text": "ok"}], "tool_call_id": "c"},
    ] * (MAX_MESSAGES // 2)  # a long conversation of tool calls and their answers holds
    assert len(p.decode(generate(turns)).messages) == MAX_MESSAGES
    deep = [[[[1] * 63] * 63] * 63] * 4  # each level within the 64 a level may hold
    bomb = [{"role": "user", "content": deep}]
    seen = []

    class Counted(list):  # NOTE: counts reads of the items, to show the count stops early
        def __iter__(self):
            seen.append(len(self))
            return super().__iter__()

    with pytest.raises(p.ProtocolError, match=f"more than {MAX_MESSAGE_ITEMS} items in all"):
        p.decode(generate(bomb))
    from common.wire.limits import MaxItems, check_num_items

    nested = Counted([Counted([Counted([0] * 63) for _ in range(63)]) for _ in range(63)])
    with pytest.raises(p.ProtocolError, match="in all"):
        check_num_items({"content": nested}, MaxItems(2000), "messages")
    assert sum(seen) <= 2000 + 63 * 2  # read no further than the limit and a level past it


def test_tensor_size_mismatch_is_caught_and_request_id_kept():
    frames = p.encode(KV_EXAMPLE)
    with pytest.raises(p.ProtocolError, match="holds") as e:
        p.decode([frames[0], bytes(frames[1])[:-2]])
    assert e.value.request_id == "r1"


def test_allowed_types_filter():
    with pytest.raises(p.ProtocolError, match="unknown message type"):
        p.decode(p.encode(p.Shutdown()), allowed=(p.GenerateRequest,))


@pytest.mark.parametrize(
    "field,value",
    [
        ("timings", "soon"),
        ("timings", [1, 2]),
        ("timings", {"arrival": "now"}),
        ("timings", {"a": -1.0}),
        ("timings", {"a": float("nan")}),
        ("first_token", 2**31),
        ("prompt_len", -1),
        ("request_id", "x" * 257),
        ("prompt_ids", [1, -2]),
        ("prompt_ids", "1234"),
    ],
)
def test_field_limits_refuse_what_receivers_cannot_use(field, value):
    commit = {
        "v": 2,
        "type": "kv_commit",
        "request_id": "r1",
        "prompt_len": 4,
        "first_token": 1,
        "params": {"max_tokens": 2},
        "timings": {"prefill_end": 1.0},
        "backend": "tcp",
        "prompt_ids": [5, 6, 7, 8],
    }
    p.decode([msgpack.packb(commit)])  # as given: fine
    with pytest.raises(p.ProtocolError, match=field):
        p.decode([msgpack.packb({**commit, field: value})])


@pytest.mark.parametrize("rid", ["a\nERROR the frontend stops", "a\rb", "a\x1b[2Jb", "a\u2028b"])
def test_a_request_id_that_would_forge_a_log_line_is_refused_unnamed(rid):
    """Hunt: a request id is a client's text written into the frontend's log ("rejected
    request %s"), and one holding a newline wrote a line of the client's choosing. An id
    with a control character is refused, and the refusal does not name it."""
    for ok in ("ok id, ünïcode", "a\u200db", "a\u00a0b", "日本"):  # text, not controls
        good = {"v": 2, "type": "abort", "request_id": ok}
        assert p.decode([msgpack.packb(good)]).request_id == ok
    with pytest.raises(p.ProtocolError, match="control characters") as e:
        p.decode([msgpack.packb({**good, "request_id": rid})])
    assert e.value.request_id is None


def test_a_fields_name_in_an_error_holds_no_line_of_its_own():
    """Review: a field's name a client chose was written as it was into "X holds more than
    N items", which the frontend logs."""
    bad = {"v": 2, "type": "abort", "request_id": "r", "x\nFORGED": [1] * 9}
    with pytest.raises(p.ProtocolError) as e:
        p.decode_from([msgpack.packb(bad)], max_list_len=8)
    assert "holds more than 8 items" in str(e.value) and "\n" not in str(e.value)
    assert e.value.request_id == "r"
