"""The frontend's node link takes updates in whatever order two nodes' links deliver them:
a decode node that ends a request (max_tokens 1) can be heard before the prefill node
whose update carries the prompt's logprobs. What the client gets is the same either way."""

import asyncio
import dataclasses
import time
from types import SimpleNamespace

from common.base.request import SamplingParams, TokenLogprobs
from common.wire.protocol import TokenUpdate
from frontend import watchdog
from frontend.detok import IncrementalDetokenizer
from frontend.migrate import Migrations
from frontend.node_link import NodeMessages
from frontend.paths import PathChooser
from frontend.request import RequestState

PROMPT = [5, 6, 7, 8]
PROMPT_LPS = [TokenLogprobs(-1.0 - i, [], []) for i in range(len(PROMPT) - 1)]


class FakeTokenizer:
    all_special_ids = ()

    def __len__(self):
        return 100

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
            choices = self.by_client.get((req.client, req.request_id), [])
            if req in choices:  # as Frontend.finish: an ended choice leaves its request's list
                choices.remove(req)
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


def _watchdog_tick(hub, max_migrations: int, monkeypatch, on_send=None) -> tuple[list, list]:
    """One turn of the frontend's watchdog over hub's requests, with the moves real
    (frontend/migrate.py); -> (what it sent the nodes, the requests it queued to route
    again). on_send: awaited at each send (what another task does meanwhile)."""
    sent_nodes, requeued = [], []

    async def send_node(msg, to):
        sent_nodes.append((type(msg).__name__, msg.request_id, to))
        if on_send is not None:
            await on_send()

    num_checks = 0

    async def check_once(now):
        nonlocal num_checks
        num_checks += 1
        if num_checks > 1:  # the second turn: one turn was watched
            raise asyncio.CancelledError

    fe = SimpleNamespace(
        registry=SimpleNamespace(check=check_once),
        admission=SimpleNamespace(num_waiting=0, requeue=lambda c, r: requeued.append(r)),
        requests=hub.requests,
        finish=hub.finish,
        cfg=SimpleNamespace(max_migrations=max_migrations),
        spec=SimpleNamespace(eos_token_ids=()),
        max_model_len=64,
        nodes={
            "prefill-0": SimpleNamespace(identity=b"p"),
            "decode-0": SimpleNamespace(identity=b"d"),
        },
        node_link=SimpleNamespace(send=send_node),
        unroute=lambda r: None,
        wake_dispatch=lambda: None,
        _wake=asyncio.Event(),
    )
    fe.migrations = Migrations(fe)
    monkeypatch.setattr(watchdog, "WATCHDOG_S", 0.001)

    async def run():
        try:
            await watchdog.watchdog_loop(fe)
        except asyncio.CancelledError:
            pass

    asyncio.run(run())
    return sent_nodes, requeued


def test_a_choice_whose_prompt_logprobs_never_come_is_prefilled_again(monkeypatch):
    """Defect: the one update carrying the prompt's logprobs did not come (lost on the way,
    or dropped with a choice that had ended or moved) and the choices waiting for it failed
    with a 502 after 10s. Nothing was streamed yet: the choice is prefilled again, and its
    next life's decode updates wait for the logprobs that prefill brings."""
    hub, link, prefill, decode, req = _setup()
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9], "length", index=0)))
    assert hub.sent == [] and req.held_since is not None
    req.held_since -= watchdog.PROMPT_LOGPROBS_WAIT_S + 1
    sent_nodes, requeued = _watchdog_tick(hub, 2, monkeypatch)
    assert hub.sent == [] and requeued == [req] and req.num_migrations == 1
    assert sorted(sent_nodes) == [("NodeAbort", "r1", b"d"), ("NodeAbort", "r1", b"p")]
    assert list(hub.requests) == [req.node_id] != ["r1"] and not req.held
    assert req.continuation()[1].num_prompt_logprobs == 0  # its next prefill computes them
    req.prefill_node, req.decode_node = "prefill-0", "decode-0"  # routed again
    new_id = req.node_id
    asyncio.run(link.on_tokens(decode, TokenUpdate(new_id, [9], "length", index=0)))
    assert hub.sent == [] and req.held  # its second life waits for them too
    asyncio.run(
        link.on_tokens(prefill, TokenUpdate(new_id, [], None, index=0, prompt_logprobs=PROMPT_LPS))
    )
    assert hub.sent == [
        ("finish", "length", None, [9], {"prompt_logprobs": PROMPT_LPS, "prompt_token_ids": PROMPT})
    ]


def test_a_choice_that_ends_while_the_watchdog_waits_is_not_moved(monkeypatch):
    """The watchdog's turn awaits (a move's sends); a choice another task ends meanwhile is
    passed over, not moved: moving it would drop it twice and stop the watchdog."""
    hub, link, prefill, decode, req = _setup()
    fork = _choice(hub, req, 1)
    for c in (req, fork):
        asyncio.run(link.on_tokens(decode, TokenUpdate(c.node_id, [9], "length", index=0)))
        c.held_since -= watchdog.PROMPT_LOGPROBS_WAIT_S + 1

    async def end_the_fork():
        await hub.finish(fork, "abort", None)

    _, requeued = _watchdog_tick(hub, 2, monkeypatch, on_send=end_the_fork)
    assert requeued == [req] and list(hub.requests) == [req.node_id]
    assert hub.sent == [("finish", "abort", None, [], {})]


def test_a_forks_first_token_waits_for_the_prompt_logprobs_too(monkeypatch):
    """Defect (review): a fork's first token from its prefill node streamed at once (choice
    0's update carries the prompt's logprobs); with that update lost, the fork moved, and
    they came after its first token, or never. It waits with the decode node's updates, so
    it moves with nothing streamed, and its next prefill brings them first."""
    hub, link, prefill, decode, req = _setup(max_tokens=2)
    fork = _choice(hub, req, 1)
    hub.by_client[(b"c", "r1")] = [req, fork]
    asyncio.run(link.on_tokens(prefill, TokenUpdate("f1", [7], None, index=0)))
    asyncio.run(link.on_tokens(decode, TokenUpdate("f1", [7, 8], "length", index=0)))
    assert hub.sent == [] and len(fork.held) == 2  # choice 0's update never comes
    fork.held_since -= watchdog.PROMPT_LOGPROBS_WAIT_S + 1
    _, requeued = _watchdog_tick(hub, 2, monkeypatch)
    assert requeued == [fork] and fork.output_ids == []
    assert fork.continuation() == (PROMPT, fork.params)  # its next prefill: the prompt's logprobs
    fork.prefill_node, fork.decode_node = "prefill-0", "decode-0"  # routed again, alone
    lps = TokenUpdate(fork.node_id, [7], None, index=0, prompt_logprobs=PROMPT_LPS)
    asyncio.run(link.on_tokens(prefill, lps))
    asyncio.run(link.on_tokens(decode, TokenUpdate(fork.node_id, [7, 8], "length", index=0)))
    assert hub.sent == [
        ("reply", [7], PROMPT_LPS),
        ("finish", "length", None, [7, 8], {}),
    ]


def test_a_forks_first_token_heard_before_choice_0s_streams_once_they_come():
    hub, link, prefill, decode, req = _setup(max_tokens=2)
    fork = _choice(hub, req, 1)
    hub.by_client[(b"c", "r1")] = [req, fork]
    asyncio.run(link.on_tokens(prefill, TokenUpdate("f1", [7], None, index=0)))
    assert hub.sent == [] and fork.held
    lps = TokenUpdate("r1", [9], None, index=0, prompt_logprobs=PROMPT_LPS)
    asyncio.run(link.on_tokens(prefill, lps))
    assert hub.sent == [("reply", [7], PROMPT_LPS), ("reply", [9], PROMPT_LPS)]
    assert fork.output_ids == [7] and not fork.held


def test_a_prefill_node_that_sends_the_wrong_number_of_prompt_logprobs_fails_the_request():
    """One per prompt token after the first, or the node is wrong: every choice ends with
    an error naming it, instead of answering with a prompt's logprobs cut short."""
    hub, link, prefill, decode, req = _setup()
    fork = _choice(hub, req, 1)
    hub.by_client[(b"c", "r1")] = [req, fork]
    failed = []

    async def fail_request(r, error, status):
        failed.append((r.node_id, error, status))

    hub.fail_request = fail_request
    few = TokenUpdate("r1", [], None, index=0, prompt_logprobs=PROMPT_LPS[:1])
    asyncio.run(link.on_tokens(prefill, few))
    why = "prefill node prefill-0 sent 1 prompt logprobs for a prompt of 4 tokens"
    assert failed == [("r1", why, 502)] and fork.prompt_logprobs is None and hub.sent == []


def test_a_choice_whose_prompt_logprobs_never_come_past_its_moves_ends_with_an_error(
    monkeypatch,
):
    hub, link, prefill, decode, req = _setup()
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9], "length", index=0)))
    req.held_since -= watchdog.PROMPT_LOGPROBS_WAIT_S + 1
    _, requeued = _watchdog_tick(hub, 0, monkeypatch)
    assert requeued == [] and hub.sent == [
        (
            "finish",
            "error",
            f"the prompt's logprobs did not come from prefill node prefill-0 in "
            f"{watchdog.PROMPT_LOGPROBS_WAIT_S:.0f}s",
            [],
            {},
        )
    ]


def _choice(hub, req, index: int) -> RequestState:
    """Choice `index` of req's request, routed with it (as its fork)."""
    choice = RequestState(
        f"f{index}",
        "r1",
        b"c",
        list(PROMPT),
        req.params,
        IncrementalDetokenizer(FakeTokenizer()),
        time.time(),
        time.monotonic() + 60,
        prefill_node="prefill-0",
        decode_node="decode-0",
        index=index,
    )
    hub.requests[choice.node_id] = choice
    return choice


def test_every_choice_held_for_the_prompt_logprobs_gets_them_when_they_come():
    """Defect (CI: n=16 with prompt_logprobs, a 502 after 10s): every choice's decode update
    was heard first and waited; when the logprobs came, each choice released ended and left
    its request's list while that list was walked, so every other choice was passed over and
    waited on for logprobs that had come."""
    hub, link, prefill, decode, req = _setup()
    choices = [req, *(_choice(hub, req, i) for i in range(1, 6))]
    hub.by_client[(b"c", "r1")] = list(choices)
    for c in choices:
        asyncio.run(link.on_tokens(decode, TokenUpdate(c.node_id, [9], "length", index=0)))
    assert hub.sent == [] and all(c.held for c in choices)
    asyncio.run(
        link.on_tokens(prefill, TokenUpdate("r1", [], None, index=0, prompt_logprobs=PROMPT_LPS))
    )
    with_them = (
        "finish",
        "length",
        None,
        [9],
        {"prompt_logprobs": PROMPT_LPS, "prompt_token_ids": PROMPT},
    )
    assert hub.sent == [with_them] * 6 and not hub.requests


def test_the_prompt_logprobs_come_once_and_every_choice_of_the_request_gets_them():
    """Defect: the prefill node sent the prompt's logprobs with each of n choices' updates
    (n=64, 20 logprobs, 1,000 prompt tokens: ~19 MiB in one message, past the link's limit,
    which dropped the link). They come once, with choice 0's update: a choice whose decode
    node was heard first waits for them, then streams them with its tokens."""
    hub, link, prefill, decode, req = _setup(max_tokens=2)
    fork = _choice(hub, req, 1)
    hub.by_client[(b"c", "r1")] = [req, fork]
    asyncio.run(link.on_tokens(decode, TokenUpdate("f1", [7, 8], "length", index=0)))
    assert hub.sent == [] and fork.held  # its decode node first: it waits
    asyncio.run(
        link.on_tokens(prefill, TokenUpdate("r1", [9], None, index=0, prompt_logprobs=PROMPT_LPS))
    )
    asyncio.run(
        link.on_tokens(prefill, TokenUpdate("f1", [7], None, index=0))
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


def test_a_node_that_floods_a_held_choice_with_updates_fails_it():
    """A node's updates for a choice waiting for the prompt's logprobs are kept unread; one
    that sends more than its tokens explain (a hostile or broken node), in updates or in
    their length, ends that choice with an error naming it, not our memory."""
    hub, link, prefill, decode, req = _setup(max_tokens=4)
    for i in range(12):  # twice a life's: max_tokens + 2
        asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9], None, index=0)))
    assert hub.sent == [] and len(req.held) == 12
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9], None, index=0)))
    (sent,) = hub.sent
    assert sent[:2] == ("finish", "error") and "decode node decode-0 sent more" in sent[2]
    assert "(13 updates, size 26" in sent[2]
    assert "r1" not in hub.requests
    hub, link, prefill, decode, req = _setup(max_tokens=4)
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9] * 10**5, None, index=0)))
    (sent,) = hub.sent  # one update, of more tokens than the choice can make
    assert sent[:2] == ("finish", "error") and "(1 updates, size 100001" in sent[2]
    # nor in logprobs it holds unread: the prompt's, from a node that does not send them
    hub, link, prefill, decode, req = _setup(max_tokens=4)
    lps = [TokenLogprobs(-1.0, [], [])] * 100
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9], None, 0, prompt_logprobs=lps)))
    (sent,) = hub.sent
    assert sent[:2] == ("finish", "error") and "(1 updates, size 102" in sent[2]
    # nor in top logprobs beside no top ids (the wire does not hold the two to one length)
    hub, link, prefill, decode, req = _setup(max_tokens=4)
    lps = [TokenLogprobs(-1.0, [], [-1.0] * 100)]
    asyncio.run(link.on_tokens(decode, TokenUpdate("r1", [9], None, index=0, logprobs=lps)))
    (sent,) = hub.sent
    assert sent[:2] == ("finish", "error") and "(1 updates, size 103" in sent[2]


def test_a_well_behaved_life_stays_within_what_a_held_choice_may_hold():
    """The most a life's nodes send before the prompt's logprobs come: the prefill node's
    token, the decode node's first update (the same token again), one a step, and one of
    counts alone, each token with its logprob and top 5: all held, none refused."""
    hub, link, prefill, decode, req = _setup(max_tokens=6)
    req.params = dataclasses.replace(req.params, num_logprobs=5)
    lp = [TokenLogprobs(-1.0, [1, 2, 3, 4, 5], [-1.0] * 5)]
    updates = [(prefill, TokenUpdate("r1", [9], None, index=0, logprobs=lp))]
    updates += [(decode, TokenUpdate("r1", [9 + i], None, index=i, logprobs=lp)) for i in range(6)]
    updates.append((decode, TokenUpdate("r1", [], "length", index=6)))
    for node, u in updates:
        asyncio.run(link.on_tokens(node, u))
    assert hub.sent == [] and len(req.held) == 8


def test_a_speculative_life_stays_within_what_a_held_choice_may_hold():
    """With speculative decoding a decode update carries several tokens (a verify step's
    accepted drafts and its own), each with its logprob and top 5: fewer updates, as many
    tokens; the first repeats the prefill node's token with the drafts that followed it."""
    hub, link, prefill, decode, req = _setup(max_tokens=6)
    req.params = dataclasses.replace(req.params, num_logprobs=5)
    lp = TokenLogprobs(-1.0, [1, 2, 3, 4, 5], [-1.0] * 5)
    runs = [[9, 10, 11, 12], [13, 14]]  # 6 tokens: the first repeated, then 4 steps' worth
    updates = [(prefill, TokenUpdate("r1", [9], None, index=0, logprobs=[lp]))]
    updates += [
        (
            decode,
            TokenUpdate("r1", run, None, index=sum(map(len, runs[:i])), logprobs=[lp] * len(run)),
        )
        for i, run in enumerate(runs)
    ]
    updates.append((decode, TokenUpdate("r1", [], "length", index=6)))
    for node, u in updates:
        asyncio.run(link.on_tokens(node, u))
    assert hub.sent == [] and len(req.held) == 4


def test_a_stop_string_inside_a_verify_steps_update_ends_the_tokens_there():
    """A decode update of several tokens (a verify step's) whose second completes a stop
    string: the client gets the tokens to it, their logprobs, and usage that counts them,
    as one token a step would have given; those after it are not the request's."""
    hub, link, prefill, decode, req = _setup(num_prompt_logprobs=-1, max_tokens=16)
    req.params = dataclasses.replace(req.params, num_logprobs=0)
    req.detok = IncrementalDetokenizer(FakeTokenizer(), ["cd"])  # tokens 2 and 3 make "cd"
    finished = []

    async def finish(r, reason, error, token_ids=(), logprobs=None, **kw):
        hub.requests.pop(r.node_id, None)
        finished.append((reason, list(token_ids), logprobs, r.final_output(reason, None, [], [])))

    hub.finish = finish
    lps = [TokenLogprobs(-0.5 - i, [], []) for i in range(5)]
    asyncio.run(link.on_tokens(prefill, TokenUpdate("r1", [1], None, index=0, logprobs=lps[:1])))
    update = TokenUpdate("r1", [1, 2, 3, 4, 5], None, index=0, logprobs=lps)
    asyncio.run(link.on_tokens(decode, update))
    [(reason, token_ids, logprobs, out)] = finished
    assert (reason, token_ids, logprobs) == ("stop", [2, 3], lps[1:3])
    assert req.output_ids == [1, 2, 3]
    assert out.usage["completion_tokens"] == 3 and out.text == "b"


def test_a_retryable_failure_is_logged_as_said_by_the_node_that_said_it():
    """A prefill node's retryable failure (its own: a grammar it could not compile) moved
    the request with a log that blamed the decode node alone; the move's reason now names
    the node that said it."""
    from common.wire.protocol import RequestFailed

    hub, _, prefill, decode, _ = _setup()
    moved = []

    async def move_or_fail(req, lost, cause, why):
        moved.append((lost, cause, why))

    link = NodeMessages(hub, SimpleNamespace(move_or_fail=move_or_fail))
    nodes = {b"p": prefill, b"d": decode}
    hub.registry = SimpleNamespace(by_identity=nodes.get, seen=lambda node: None)
    for sender, error in ((b"p", "the grammar could not be compiled here"), (b"d", "cut")):
        asyncio.run(link.on_message(sender, RequestFailed("r1", error, is_retryable=True)))
    assert moved == [
        ("decode-0", "handoff", "prefill-0: the grammar could not be compiled here"),
        ("decode-0", "handoff", "cut"),
    ]
