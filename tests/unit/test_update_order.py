"""The frontend's node link takes updates in whatever order two nodes' links deliver them:
a decode node that ends a request (max_tokens 1) can be heard before the prefill node
whose update carries the prompt's logprobs. What the client gets is the same either way."""

import asyncio
import time
from types import SimpleNamespace

from common.base.request import SamplingParams, TokenLogprobs
from common.wire.protocol import TokenUpdate
from frontend import server
from frontend.detok import IncrementalDetokenizer
from frontend.node_link import NodeMessages
from frontend.paths import PathChooser
from frontend.request import RequestState

PROMPT = [5, 6, 7, 8]
PROMPT_LPS = [TokenLogprobs(-1.0 - i, [], []) for i in range(len(PROMPT) - 1)]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class FakeHub:
    """The parts of the frontend the node link calls; finish and reply record what a
    client would get."""

    def __init__(self):
        self.spec = SimpleNamespace(vocab_size=100)
        self.requests, self.nodes, self.sent, self.outbox = {}, {}, [], None
        self.by_client = {}
        self.node_link = SimpleNamespace(send=self._send_node)

    async def _send_node(self, msg, to):
        pass

    async def finish(
        self, req, reason, error, token_ids=(), is_node_done=False, status=None, logprobs=None
    ):
        if self.requests.pop(req.node_id, None) is not None:
            self.sent.append(
                ("finish", reason, error, list(req.output_ids), req.take_prompt_logprobs())
            )

    async def reply(self, client, msg, status=None):
        self.sent.append(("reply", msg.token_ids, msg.prompt_logprobs))

    def wake_dispatch(self):
        pass


def _setup(num_prompt_logprobs=0, max_tokens=1):
    hub = FakeHub()
    prefill = SimpleNamespace(name="prefill-0", role="prefill", identity=b"p")
    decode = SimpleNamespace(name="decode-0", role="decode", identity=b"d")
    params = SamplingParams(max_tokens=max_tokens, num_prompt_logprobs=num_prompt_logprobs)
    req = RequestState(
        "r1",
        "r1",
        b"c",
        list(PROMPT),
        params,
        IncrementalDetokenizer(FakeTokenizer()),
        time.time(),
        time.monotonic() + 60,
        prefill_node="prefill-0",
        decode_node="decode-0",
    )
    hub.requests["r1"] = req
    return hub, NodeMessages(hub, SimpleNamespace(timings=lambda r, p: p)), prefill, decode, req


def _run(order, **kw):
    hub, link, prefill, decode, req = _setup(**kw)
    from_prefill = (prefill, TokenUpdate("r1", [], None, index=0, prompt_logprobs=PROMPT_LPS))
    from_decode = (decode, TokenUpdate("r1", [9], "length", index=0))
    for node, u in (
        (from_prefill, from_decode) if order == "prefill first" else (from_decode, from_prefill)
    ):
        asyncio.run(link.on_tokens(node, u))
    return hub, req


def test_the_prompt_logprobs_reach_the_client_whichever_node_is_heard_first():
    for order in ("prefill first", "decode first"):
        hub, req = _run(order)
        assert hub.sent == [
            (
                "finish",
                "length",
                None,
                [9],
                {"prompt_logprobs": PROMPT_LPS, "prompt_token_ids": PROMPT},
            )
        ], order
        assert not req.held


def test_a_decode_update_waits_only_when_the_prompt_logprobs_were_asked_for():
    hub, link, prefill, decode, req = _setup(num_prompt_logprobs=-1)
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9], "length", index=0)))
    assert hub.sent == [("finish", "length", None, [9], {})]


def test_held_updates_stream_in_order_once_the_prompt_logprobs_come():
    hub, link, prefill, decode, req = _setup(max_tokens=4)
    for u in (TokenUpdate("r1", [9, 10], None, index=0), TokenUpdate("r1", [11], None, index=2)):
        asyncio.run(link.on_tokens(decode, u))
    assert hub.sent == [] and len(req.held) == 2
    asyncio.run(
        link.on_tokens(prefill, TokenUpdate("r1", [9], None, index=0, prompt_logprobs=PROMPT_LPS))
    )
    # The prefill node's first token, with the prompt's logprobs; then the decode node's rest.
    assert hub.sent == [("reply", [9], PROMPT_LPS), ("reply", [10], None), ("reply", [11], None)]
    assert req.output_ids == [9, 10, 11] and not req.held


def test_a_request_whose_prompt_logprobs_never_come_ends_with_an_error(monkeypatch):
    hub, link, prefill, decode, req = _setup()
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9], "length", index=0)))
    assert hub.sent == [] and req.held_since is not None
    fe = SimpleNamespace(
        registry=SimpleNamespace(check=_nothing),
        admission=SimpleNamespace(num_waiting=0),
        requests=hub.requests,
        finish=hub.finish,
        migrations=None,
        _wake=asyncio.Event(),
    )
    req.held_since -= server.PROMPT_LOGPROBS_WAIT_S + 1
    monkeypatch.setattr(server, "WATCHDOG_S", 0.001)

    async def one_tick():
        task = asyncio.ensure_future(server.Frontend._watchdog_loop(fe))
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(one_tick())
    assert hub.sent == [
        (
            "finish",
            "error",
            "the prompt's logprobs did not come from prefill node prefill-0",
            [],
            {},
        )
    ]


async def _nothing(now):
    pass


def test_the_prompt_logprobs_come_once_and_every_choice_of_the_request_gets_them():
    """Defect: the prefill node sent the prompt's logprobs with each of n choices' updates
    (n=64, 20 logprobs, 1,000 prompt tokens: ~19 MiB in one message, past the link's limit,
    which dropped the link). They come once, with choice 0's update: a choice whose decode
    node was heard first waits for them, then streams them with its tokens."""
    hub, link, prefill, decode, req = _setup(max_tokens=2)
    fork = RequestState(
        "r1.1",
        "r1",
        b"c",
        list(PROMPT),
        req.params,
        IncrementalDetokenizer(FakeTokenizer()),
        time.time(),
        time.monotonic() + 60,
        prefill_node="prefill-0",
        decode_node="decode-0",
        index=1,
    )
    hub.requests["r1.1"] = fork
    hub.by_client[(b"c", "r1")] = [req, fork]
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1.1", [7, 8], "length", index=0)))
    assert hub.sent == [] and fork.held  # its decode node first: it waits
    asyncio.run(
        link.on_tokens(prefill, TokenUpdate("r1", [9], None, index=0, prompt_logprobs=PROMPT_LPS))
    )
    asyncio.run(
        link.on_tokens(prefill, TokenUpdate("r1.1", [7], None, index=0))
    )  # none with the fork's
    assert hub.sent == [
        (
            "finish",
            "length",
            None,
            [7, 8],
            {"prompt_logprobs": PROMPT_LPS, "prompt_token_ids": PROMPT},
        ),
        ("reply", [9], PROMPT_LPS),
    ]
    assert fork.prompt_logprobs == PROMPT_LPS and not fork.held


def test_a_last_update_of_counts_alone_is_no_handoff_for_the_path_rule():
    """Defect: a decode node's last update carrying only counts (drafts, preemptions) was
    taken as a handoff of 0 s, pulling the path rule's estimate of the node's handoffs
    down with every request it finished."""
    hub, link, prefill, decode, req = _setup(num_prompt_logprobs=-1, max_tokens=4)
    hub.paths = PathChooser("auto", time.monotonic)
    hub.paths.observe_handoff("decode-0", len(req.prompt_ids), 0.050)
    req.timings["path"] = "disaggregated"
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9, 10], None, index=0)))
    parts = {"num_draft_tokens": 4, "num_accepted_tokens": 2, "num_preemptions": 1}
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [11, 12], "length", parts, index=2)))
    assert hub.paths.handoff_s["decode-0"] == 0.050
    assert req.timings["num_accepted_tokens"] == 2
