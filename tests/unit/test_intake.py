"""What a client's request may cost the frontend, checked before any work: its n against
the decode nodes' batch rows and its client's limits, every list counted before its
items are read, and tools counted as text. In this process, on the frontend's own
classes (no node runs: a registered node is a NodeState)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from common.base.config import FrontendConfig
from common.wire.protocol import ErrorReply, GenerateOutput, GenerateRequest, NodeReady
from frontend import router
from frontend.admission import Admission
from frontend.router import NodeState

CLIENT = ("http", "127.0.0.1")


@pytest.fixture(scope="module")
def make_frontend(tiny_model):
    from frontend.server import Frontend

    made = []

    def make(*rows: int, **cfg):
        """A frontend with a prefill node and a decode node of each of rows' batch sizes
        registered; its replies collect in fe.replies as (message, HTTP status)."""
        fe = Frontend(
            FrontendConfig(
                model=str(tiny_model),
                client_endpoint="tcp://127.0.0.1:1",
                node_endpoint="tcp://127.0.0.1:2",
                **cfg,
            )
        )
        fe.replies = []
        fe.local_sink = lambda client, msg, status: fe.replies.append((msg, status))
        fe._wake = asyncio.Event()
        if rows:
            fe.nodes["prefill-0"] = _node("prefill", "prefill-0")
        for i, r in enumerate(rows):
            fe.nodes[f"decode-{i}"] = _node("decode", f"decode-{i}", r)
        made.append(fe)
        return fe

    yield make
    for fe in made:
        fe.prompts.close()


def _node(role: str, name: str, rows: int = 0) -> NodeState:
    ready = NodeReady(
        role,
        name,
        1,
        "1",
        "cpu",
        64,
        16,
        512,
        max_batch_size=rows,
        kv_endpoint="tcp://127.0.0.1:9" if role == "decode" else None,
    )
    return NodeState(ready, f"{name}/1".encode(), time.monotonic())


def _submit(fe, *reqs: GenerateRequest) -> list[tuple]:
    """Submit each request, let any work off the loop end; the replies."""

    async def run():
        for r in reqs:
            await fe.submit(CLIENT, r)
        await _settled(fe)

    asyncio.run(run())
    return fe.replies


async def _settled(fe) -> None:
    """Every request being tokenized has been admitted or answered."""
    deadline = time.monotonic() + 60
    while fe.intake._tasks and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not fe.intake._tasks


def _error(reply: tuple) -> tuple[str, int]:
    msg, status = reply
    assert isinstance(msg, (GenerateOutput, ErrorReply)) and msg.error, msg
    return msg.error, status


# ---- n against the decode nodes' rows, and the client's limits -----------------------------


def test_n_above_every_decode_nodes_rows_is_refused_naming_the_limit(make_frontend):
    """Defect: n was never compared with the rows a decode node has: n=64 overflowed a
    decode node's batch of 16 (and killed it); n above every node's --max-batch-size
    could never run. Refused with a 400 naming the rows, before any work."""
    fe = make_frontend(8, 16)
    (reply,) = _submit(fe, GenerateRequest("a", prompt_token_ids=[1, 2, 3], max_tokens=2, n=17))
    error, status = _error(reply)
    assert status == 400 and "16 rows" in error and "--max-batch-size" in error, error
    assert not fe.requests
    _submit(fe, GenerateRequest("b", prompt_token_ids=[1, 2, 3], max_tokens=2, n=16))
    assert len(fe.requests) == 16 and len(fe.replies) == 1  # admitted: the largest node holds it


@pytest.mark.parametrize("rows", [(), (0, 16)], ids=["none-registered", "one-unsaid"])
def test_n_is_not_refused_for_rows_no_decode_node_has_said(make_frontend, rows):
    fe = make_frontend(*rows)
    _submit(fe, GenerateRequest("a", prompt_token_ids=[1, 2, 3], max_tokens=2, n=64))
    assert all("rows" not in _error(r)[0] for r in fe.replies)
    assert bool(fe.requests) == bool(rows)  # with no node: 503, no live pair


def test_n_choices_go_only_to_a_decode_node_whose_batch_holds_them():
    nodes = {
        "p": _node("prefill", "p"),
        "small": _node("decode", "small", 4),
        "big": _node("decode", "big", 32),
    }
    nodes["big"].num_active = 20  # busier: the small one is chosen for one row
    assert router.choose(nodes)[1].name == "small"
    assert router.choose(nodes, num_rows=8)[1].name == "big"
    assert router.assign(nodes, 10**6, [1, 2, 3], {}, num_rows=8)[1].name == "big"
    assert router.choose({k: v for k, v in nodes.items() if k != "big"}, num_rows=8) is None
    assert router.max_rows(nodes) == 32


def test_a_request_waiting_for_rows_no_live_node_has_fails_instead_of_holding_the_line(
    make_frontend,
):
    """The only decode node big enough for n=8 died after it was admitted: it fails (503)
    and the requests behind it go on."""
    fe = make_frontend(4, 32)
    sent = []

    async def send(msg, to):
        sent.append(msg)

    fe.node_link = type("Link", (), {"send": staticmethod(send)})()

    async def run():
        await fe.submit(
            CLIENT, GenerateRequest("wide", prompt_token_ids=[1, 2, 3], max_tokens=2, n=8)
        )
        await fe.submit(CLIENT, GenerateRequest("one", prompt_token_ids=[4, 5, 6], max_tokens=2))
        fe.nodes["decode-1"].is_alive = False
        task = asyncio.create_task(fe._dispatch_loop())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if sent:
                break
        task.cancel()

    asyncio.run(run())
    assert [m.request_id for m in sent] == [fe.by_client[(CLIENT, "one")][0].node_id]
    assert (CLIENT, "wide") not in fe.by_client
    errors = [(m.request_id, m.error, s) for m, s in fe.replies]
    assert len(errors) == 8 and all(
        rid == "wide" and "8 batch rows" in e and s == 503 for rid, e, s in errors
    ), errors


def test_admission_counts_every_choice_before_it_admits():
    """Defect: admission compared the requests in flight with the limit before adding
    the request's n, so a client at 2 of 4 was admitted with n=3 (5 in flight)."""
    a = Admission(max_requests=4, max_kv_tokens=10**6)
    for i in range(2):
        a.add("c", i, 10)
    why = a.refusal("c", 30, 3)
    assert why is not None and "2 requests in flight, and this request adds 3" in why
    assert a.refusal("c", 20, 2) is None


def test_the_prompts_waiting_over_all_clients_are_bounded(make_frontend):
    """Found by a hunt: each client's limits held, but nothing bounded what all clients
    together left waiting here (each connection 2^24 KV tokens of prompts, 0.63 GiB of
    ids): prompt tokens waiting over all clients are counted as they wait and leave, and
    a request past the bound is refused whoever sends it (a 503 naming the flag)."""
    a = Admission(4096, 10**6, max_waiting_tokens=10, num_tokens_of=len)
    a.add("c1", "abcd", 8)
    a.add("c2", "efg", 7)
    a.add("c2", "xyzxyzxyz", 9, is_waiting=False)  # a fork: it waits with its lead
    assert a.num_waiting_tokens == 7 and a.overload(3) is None
    why = a.overload(4)
    assert "7 prompt tokens wait" in why and "--max-waiting-tokens 10" in why
    assert a.next() == "abcd" and a.num_waiting_tokens == 3  # sent to the nodes
    a.requeue("c1", "abcd")  # it moves: it waits again
    assert a.num_waiting_tokens == 7
    a.done("c2", "efg", 7)
    a.done("c1", "abcd", 8)
    assert a.num_waiting_tokens == 0 and a.num_refused == 1
    assert a.overload(50) is None  # nothing waits: one prompt past the bound still may

    fe = make_frontend(16, max_waiting_tokens=12)
    other = ("http", "127.0.0.2")
    replies = _submit(fe, GenerateRequest("a", prompt_token_ids=[1] * 8, max_tokens=2))
    assert not replies and fe.admission.num_waiting_tokens == 8  # no dispatch runs here

    async def from_another_client():
        await fe.submit(other, GenerateRequest("b", prompt_token_ids=[1] * 5, max_tokens=2))
        await _settled(fe)

    asyncio.run(from_another_client())
    (reply,) = fe.replies
    error, status = _error(reply)
    assert status == 503 and error.startswith("overloaded:") and "--max-waiting-tokens" in error
    assert fe.admission.num_waiting_tokens == 8


def test_n_above_the_clients_request_limit_is_a_400_not_a_retry(make_frontend):
    fe = make_frontend(64, max_requests_per_client=8)
    (reply,) = _submit(fe, GenerateRequest("a", prompt_token_ids=[1, 2, 3], max_tokens=2, n=9))
    error, status = _error(reply)
    assert status == 400 and "--max-requests-per-client" in error


# ---- every list counted before its items, tools counted as text ------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("bad_words", ["w"] * 200_000),
        ("bad_words", ["word " * 200] * 100),
        ("stop", ["s"] * 10_000),
        ("stop_token_ids", list(range(5000))),
        ("logit_bias", {str(i): 1.0 for i in range(5000)}),
        ("allowed_token_ids", [1] * (2**20 + 1)),
        ("messages", [{"role": "user", "content": "x"}] * 5000),
    ],
)
def test_a_list_is_counted_before_any_item_is_read(make_frontend, field, value):
    """Defect: bad_words had no count limit over HTTP, and every word was tokenized (twice)
    before the limit was checked: 200,000 words held the loop for 5-7 s before the 400.
    Each list of a request made in process (HTTP's) is counted against the limit a ZeroMQ
    client's is held to, and its characters in all, before any item is tokenized."""
    fe = make_frontend(16)
    encode = fe.tokenizer.encode
    num_tokenized = []
    fe.tokenizer.encode = lambda *a, **k: (num_tokenized.append(1), encode(*a, **k))[1]
    source = {} if field == "messages" else {"prompt": "hi"}
    (reply,) = _submit(fe, GenerateRequest("a", **source, max_tokens=2, **{field: value}))
    error, status = _error(reply)
    assert status == 400 and field in error and ("items" in error or "characters" in error), error
    assert not num_tokenized and not fe.requests


def test_tools_and_tool_calls_count_as_the_prompts_text(make_frontend):
    """Defect: the tools and an assistant's tool_calls were not counted in the text length,
    so a one-word message with 2 MB of tools was rendered and tokenized on the loop (1.9 s).
    They count: such a prompt goes off the loop, or is refused unread past the longest
    text the model can take."""
    from frontend.chat_template import TOOLS_GROWTH, tools_growth
    from frontend.prompts import OFF_LOOP_CHARS, text_len

    fe = make_frontend(16)
    big = json.dumps(
        [
            {"type": "function", "function": {"name": f"f{i}", "description": "d" * 1000}}
            for i in range(2000)
        ]
    )  # 2 MB
    tools = GenerateRequest("t", messages=[{"role": "user", "content": "hi"}], tools=big)
    calls = GenerateRequest(
        "c",
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "f", "arguments": {"x": "y" * 100_000}},
                    }
                ],
            },
        ],
    )
    # Found by a hunt: 64 KB of short numbers the template writes again four times longer
    # (`9e15`: `9000000000000000.0`), tokenized on the loop as if 64 KB; and a review: a
    # template that indents them writes a line a nested item. The tools count as long as
    # the model's template may write them, and nest at most MAX_TOOLS_DEPTH levels.
    x = ",".join(["9e15"] * 12_000)
    grows = '[{"type": "function", "function": {"name": "f", "x": [' + x + "]}}]"
    assert len(grows) < OFF_LOOP_CHARS
    grows = GenerateRequest("g", messages=[{"role": "user", "content": "hi"}], tools=grows)
    for req in (tools, calls):
        assert text_len(req) > OFF_LOOP_CHARS and fe.prompts.is_off_loop(req)
    assert fe.prompts.is_off_loop(grows) and fe.prompts.tools_growth == TOOLS_GROWTH
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 100}}
    agent = GenerateRequest(
        "s", messages=[{"role": "user", "content": "hi"}], tools=json.dumps([tool] * 40)
    )
    assert not fe.prompts.is_off_loop(agent)  # an agent's few kilobytes of tools: on the loop
    indenting = SimpleNamespace(chat_template="{{ tools | tojson(indent=4) }}")
    fe.prompts.tools_growth = tools_growth(indenting)  # a template that indents: far less
    assert fe.prompts.is_off_loop(agent)
    fe.prompts.tools_growth = TOOLS_GROWTH
    deep = "[" * 40 + "]" * 40
    deep = GenerateRequest("d", messages=[{"role": "user", "content": "hi"}], tools=deep)
    (reply,) = _submit(fe, deep)
    error, status = _error(reply)
    assert status == 400 and "tools nest more than 32 levels deep" in error, error
    fe.replies.clear()
    (reply,) = _submit(fe, tools)
    error, status = _error(reply)
    assert status == 400 and "characters (its messages, tool calls and tools)" in error, error


# ---- the thread for work off the loop: clients take turns, each with a bounded share ---------


def test_one_clients_flood_of_off_loop_work_waits_its_turns_and_is_bounded():
    """Defect: requests waiting for the tokenizing thread or the grammar checker had no
    bound, and waited in one line: one client's 10,000 distinct grammars held everyone's
    structured outputs. Each client now has a line of its own, of at most its share (one
    more is a 429 saying why), and the thread takes the lines in turn."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from frontend.off_loop import Busy, OffLoop

    gate, ran = threading.Event(), []

    def job(name):
        gate.wait(10)
        ran.append(name)
        return name

    async def run():
        pool = ThreadPoolExecutor(1)
        off = OffLoop(pool, max_per_client=8)
        flood = [asyncio.create_task(off.run("a", job, f"a{i}")) for i in range(10_000)]
        await asyncio.sleep(0.05)
        refused = [t for t in flood if t.done() and isinstance(t.exception(), Busy)]
        light = asyncio.create_task(off.run("b", job, "b0"))
        left = asyncio.create_task(off.run("a", job, "a-cancelled"))  # refused too: a is full
        flood[5].cancel()  # waiting: taken out of the line
        await asyncio.sleep(0.05)
        gate.set()
        assert await light == "b0"
        await asyncio.gather(*flood, left, return_exceptions=True)
        pool.shutdown()
        return refused, left, off

    refused, left, off = asyncio.run(run())
    assert len(refused) == 10_000 - 8 and isinstance(left.exception(), Busy)
    assert "waiting to be tokenized" in str(
        refused[0].exception()
    ) and "limit per client is 8" in str(refused[0].exception())
    assert ran[:2] == ["a0", "b0"]  # b waited for one job of a's
    assert ran == ["a0", "b0", "a1", "a2", "a3", "a4", "a6", "a7"]
    assert not off._counts  # no client holds a count once its jobs have ended


def test_a_clients_work_off_the_loop_past_its_share_is_refused_and_another_client_goes_first(
    make_frontend,
):
    """Through the frontend: a client with more requests than its share waiting for the
    tokenizing thread gets 429s at once; another client's request is prepared next."""
    from frontend.off_loop import MAX_PER_CLIENT

    fe = make_frontend(16)
    order = []
    prepare = fe.prompts._prepare_here

    def recorded(req):
        order.append(req.request_id)
        return prepare(req)

    fe.prompts._prepare_here = recorded
    fe.prompts.is_off_loop = lambda req: True  # as a long prompt or a grammar is

    async def run():
        for i in range(MAX_PER_CLIENT + 3):
            await fe.submit(("http", "heavy"), GenerateRequest(f"h{i}", prompt="hi", max_tokens=2))
        await fe.submit(CLIENT, GenerateRequest("light", prompt="hi", max_tokens=2))
        await _settled(fe)

    asyncio.run(run())
    busy = [(m.request_id, s) for m, s in fe.replies if s == 429]
    assert busy == [(f"h{i}", 429) for i in range(MAX_PER_CLIENT, MAX_PER_CLIENT + 3)]
    assert order.index("light") <= 1 and len(order) == MAX_PER_CLIENT + 1
    assert len(fe.by_client) == MAX_PER_CLIENT + 1  # every other one admitted


def test_a_request_cancelled_while_it_waits_for_the_thread_never_runs(make_frontend):
    fe = make_frontend(16)
    order = []
    prepare = fe.prompts._prepare_here
    fe.prompts._prepare_here = lambda req: (
        order.append(req.request_id),
        time.sleep(0.2),
        prepare(req),
    )[2]
    fe.prompts.is_off_loop = lambda req: True

    async def run():
        await fe.submit(CLIENT, GenerateRequest("first", prompt="hi", max_tokens=2))
        await fe.submit(CLIENT, GenerateRequest("second", prompt="hi", max_tokens=2))
        await asyncio.sleep(0.05)
        await fe.abort(CLIENT, "second")
        await _settled(fe)

    asyncio.run(run())
    assert order == ["first"] and set(fe.by_client) == {(CLIENT, "first")}
    ((msg, _),) = [r for r in fe.replies if r[0].request_id == "second"]
    assert msg.finish_reason == "abort" and "cancelled" in msg.error and not fe.intake.pending


def test_an_error_naming_a_request_being_prepared_does_not_end_it(make_frontend):
    """Hunt: a malformed message naming the id of a request still being prepared (its
    prompt tokenized off the loop) was answered with an output that ended that id, while
    the request was admitted and ran on for a client that had stopped reading it. The
    error is answered beside it (as a duplicate id's), and the request's own refusal
    still ends it."""
    fe = make_frontend(16)
    prepare = fe.prompts._prepare_here
    fe.prompts._prepare_here = lambda req: (time.sleep(0.2), prepare(req))[1]
    fe.prompts.is_off_loop = lambda req: True

    async def run():
        await fe.submit(CLIENT, GenerateRequest("r", prompt="hi", max_tokens=2))
        await asyncio.sleep(0.05)
        assert (CLIENT, "r") in fe.intake.pending
        await fe.reply_error(CLIENT, "r", "max_tokens must be in [0, 2147483647]")
        await _settled(fe)
        # its own refusal, made while it is prepared: its prompt is longer than the model
        await fe.submit(CLIENT, GenerateRequest("s", prompt="hi " * 5000, max_tokens=2))
        await _settled(fe)

    asyncio.run(run())
    ((msg, status),) = [r for r in fe.replies if r[0].request_id == "r"]
    assert isinstance(msg, ErrorReply) and status == 400 and "max_tokens" in msg.error
    assert (CLIENT, "r") in fe.by_client  # admitted: the error was not its
    ((msg, status),) = [r for r in fe.replies if r[0].request_id == "s"]
    assert isinstance(msg, GenerateOutput) and msg.is_finished and "exceeds" in msg.error


def test_a_restarted_frontends_requests_never_take_an_earlier_lifes_ids(make_frontend):
    """Hunt (suspected): node ids were a count from 1 in each frontend process, and nodes
    outlive a frontend that restarts: a new request could take the id of one a node still
    decoded (its tokens streamed to the new client) or had aborted in the last minute (the
    new one refused). Each life's ids are its own."""
    lives = [make_frontend(16), make_frontend(16)]
    for fe in lives:
        _submit(fe, *(GenerateRequest(f"r{i}", prompt="hi", max_tokens=2, n=2) for i in "ab"))
    first, second = (set(fe.requests) for fe in lives)
    assert len(first) == len(second) == 4 and not first & second
    assert all(i.isprintable() and len(i) < 32 for i in first | second)


# ---- a batch of prompts: one tokenized per loop turn, admitted whole or refused whole --------


class _Post:
    """What HttpServer reads of an aiohttp request."""

    def __init__(self, body: dict):
        self.body, self.remote = body, "127.0.0.1"

    async def json(self):
        return self.body


def _post(fe, body: dict, beside=None) -> tuple[int, dict]:
    """(status, body) of a completions call to fe's HTTP server; beside: a coroutine
    function run on the loop meanwhile."""
    from frontend.http import HttpServer

    server = HttpServer(fe, "m")

    async def run():
        other = asyncio.create_task(beside()) if beside else None
        response = await asyncio.wait_for(server._generate(_Post(body), "completions"), 60)
        if other:
            other.cancel()
        return response.status, json.loads(response.body)

    return asyncio.run(run())


def test_a_batchs_prompts_are_tokenized_one_per_turn_of_the_loop(make_frontend):
    """Defect: a batch of 256 prompts (completions' prompt as a list) was tokenized in one
    turn of the loop, every stream waiting meanwhile. Its prompts are tokenized one per
    turn: no turn does more than one prompt's worth."""
    fe = make_frontend()  # no node: once tokenized, the batch is refused (503)
    turns, seen = [0], []
    now = fe.prompts.now
    fe.prompts.now = lambda req: (seen.append(turns[0]), now(req))[1]

    async def count_turns():
        while True:
            turns[0] += 1
            await asyncio.sleep(0)

    status, _ = _post(
        fe, {"prompt": [f"prompt number {i}" for i in range(64)], "max_tokens": 2}, count_turns
    )
    assert status == 503 and len(seen) == 64
    assert len(set(seen)) == 64, f"{64 - len(set(seen))} prompts shared a turn of the loop"


def test_a_batch_is_admitted_whole_or_refused_whole(make_frontend):
    """Defect: an HTTP batch one prompt of which was refused as overloaded (429) still ran
    the others, for nobody (the batch was answered with the 429). The batch's choices and
    KV tokens are counted together: refused, none of it starts; admitted, all of it."""
    fe = make_frontend(16, max_requests_per_client=4)
    for i in range(3):  # three requests of this client in flight
        fe.admission.add(CLIENT, f"running-{i}", 10, is_waiting=False)
    status, body = _post(fe, {"prompt": ["a", "b"], "max_tokens": 2})
    assert status == 429
    assert "3 requests in flight, and this request adds 2" in body["error"]["message"]
    assert not fe.requests and fe.admission.clients[CLIENT].num_requests == 3
    fe.admission.done(CLIENT, "running-0", 10)
    fe.admission.done(CLIENT, "running-1", 10)

    async def admit():
        await fe.submit_group(
            CLIENT, [GenerateRequest(f"p{i}", prompt="x", max_tokens=2) for i in range(2)]
        )
        await _settled(fe)

    asyncio.run(admit())
    assert len(fe.requests) == 2 and fe.admission.clients[CLIENT].num_requests == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tokenizer_kwargs": 5},
        {"padding": "nope"},
        {"return_tensors": "pt"},
        {"chat_template": "{{ 1 / 0 }}"},
    ],
)
def test_a_chat_templates_variables_cannot_reach_its_parameters_nor_escape_as_a_fault(
    make_frontend, kwargs
):
    """chat_template_kwargs went to apply_chat_template as they came: a TypeError from one
    (tokenizer_kwargs: 5) escaped the request as the server's own fault (a 500), another
    (chat_template) ran a template of the client's choosing. They are the template's
    variables alone, and whatever rendering raises is the request's 400."""
    from frontend.prompts import prompt_ids

    fe = make_frontend(16)
    req = GenerateRequest(
        "a", messages=[{"role": "user", "content": "hi"}], max_tokens=2, chat_template_kwargs=kwargs
    )
    plain = GenerateRequest("b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert prompt_ids(fe.tokenizer, req) == prompt_ids(fe.tokenizer, plain)
    not_tools = GenerateRequest("c", messages=[{"role": "user", "content": "hi"}], tools="5")
    with pytest.raises(ValueError, match="the chat template cannot render"):
        prompt_ids(fe.tokenizer, not_tools)  # the template iterates over an int


@pytest.mark.parametrize("is_off_loop", [False, True], ids=["on-loop", "off-loop"])
def test_a_fault_while_a_request_is_prepared_is_that_requests_500(make_frontend, is_off_loop):
    """Anything but a ValueError raised while a request is tokenized (a fault of the
    frontend's own) failed nobody's request: off the loop it left the request waiting for
    good, on the loop it escaped to the client loop, and a ZeroMQ client heard nothing.
    The request is answered with a 500, and the next one is served."""
    fe = make_frontend(16)

    def broken(req):
        if req.request_id == "bad":
            raise RuntimeError("a bug")
        return fe.prompts.__class__.now(fe.prompts, req)

    fe.prompts.now = broken
    fe.prompts._prepare_here = broken
    fe.prompts.is_off_loop = lambda req: is_off_loop
    _submit(
        fe,
        GenerateRequest("bad", prompt="hi", max_tokens=2),
        GenerateRequest("good", prompt="hi", max_tokens=2),
    )
    error, status = _error(fe.replies[0])
    assert status == 500 and "internal error" in error and fe.replies[0][0].request_id == "bad"
    assert set(fe.by_client) == {(CLIENT, "good")} and not fe.intake.pending


def test_a_grammar_waits_for_the_checkers_start_on_the_loop_not_the_thread(
    make_frontend, monkeypatch
):
    """Defect: a request with a grammar waited for the grammar checker's start (seconds of
    imports) on the one thread off the loop, and every client's long prompts waited behind
    it. The wait is now on the loop, counted in the client's share of the thread: the thread
    serves others meanwhile, the grammar is checked once the start settles, and past
    START_WAIT_S the request gets a 503."""
    from common.wire.client import Structured
    from frontend import grammar_check

    class Starting:  # a checker whose start settles when told
        def __init__(self):
            self.is_started, self.checked = False, []

        def is_settled(self):
            return self.is_started

        def check(self, grammar):
            self.checked.append(grammar)

        def close(self):
            pass

    fe = make_frontend(1)
    fe.prompts._grammars = checker = Starting()
    req = GenerateRequest(
        "g", prompt_token_ids=[1, 2, 3], max_tokens=2, structured=Structured("regex", "a+")
    )

    async def run():
        waiting = asyncio.create_task(fe.prompts.off_loop("a", req))
        await asyncio.sleep(0.2)
        # another client's job runs on the thread while the grammar waits
        other = await asyncio.wait_for(fe.prompts.off_loop_jobs.run("b", lambda: "b"), 5)
        assert not waiting.done() and not checker.checked
        checker.is_started = True
        return other, await asyncio.wait_for(waiting, 5)

    other, (ids, params) = asyncio.run(run())
    assert other == "b" and ids == [1, 2, 3] and checker.checked == [("regex", "a+", "compact")]

    # the requests waiting count in their client's share of the thread
    from frontend.off_loop import Busy

    async def flood():
        fe.prompts.off_loop_jobs.max_per_client = 2
        waiting = [asyncio.create_task(fe.prompts.off_loop("a", req)) for _ in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(Busy):
            await fe.prompts.off_loop("a", req)
        checker.is_started = True
        await asyncio.gather(*waiting)
        fe.prompts.off_loop_jobs.max_per_client = 64
        return fe.prompts.off_loop_jobs._counts

    checker.is_started = False
    assert asyncio.run(flood()) == {}
    monkeypatch.setattr(grammar_check, "START_WAIT_S", 0.2)
    checker.is_started, checker.checked = False, []
    with pytest.raises(grammar_check.GrammarNotJudged, match="still starting") as e:
        asyncio.run(fe.prompts.off_loop("a", req))
    assert e.value.status == 503 and not checker.checked
    assert not fe.prompts.off_loop_jobs._counts  # its share given back

    async def cancelled():  # a client gone while its request waits gives its share back
        waiting = asyncio.create_task(fe.prompts.off_loop("a", req))
        await asyncio.sleep(0.05)
        assert fe.prompts.off_loop_jobs._counts == {"a": 1}
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return fe.prompts.off_loop_jobs._counts

    assert asyncio.run(cancelled()) == {}


def test_a_stream_that_ends_before_its_answer_is_read_keeps_its_prompt_count(
    make_frontend, monkeypatch
):
    """Defect (seen once in a full run): a short streamed request could end before its
    answer's first message was read, its state gone with it, and the stream's continuous
    usage then said 0 prompt tokens. The count is read as the first message is delivered,
    while the state lives: for a request admitted at once, and for one prepared off the
    loop (a grammar, a long prompt), which is admitted only after submit returns."""
    import types

    from common.wire.protocol import GenerateOutput
    from frontend import http as http_mod
    from frontend import openai_api as api

    seen = []

    async def stream(request, call, answers, msg, queue, num_prompt):
        seen.append(num_prompt)
        return "streamed"

    monkeypatch.setattr(http_mod, "stream", stream)
    request = types.SimpleNamespace(remote="127.0.0.1")
    client = ("http", "127.0.0.1")
    for is_off_loop in (False, True):
        fe = make_frontend(1)
        monkeypatch.setattr(fe.prompts, "is_off_loop", lambda req: is_off_loop)
        server = http_mod.HttpServer(fe, "m")
        call = api.parse(
            {
                "prompt": [5, 6, 7, 8],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            "completions",
            "m",
            64,
        )
        rid = call.request.request_id

        async def run():
            serving = asyncio.create_task(server._serve(request, [call]))
            deadline = time.monotonic() + 30
            while (client, rid) not in fe.by_client:  # admitted (off the loop: later)
                assert time.monotonic() < deadline and not fe.replies, fe.replies
                await asyncio.sleep(0.01)
            # its outputs, then its end, all before the answer reads the first one
            server._deliver(client, GenerateOutput(rid, [1], "a"), None)
            usage = {"prompt_tokens": 4, "completion_tokens": 2}
            server._deliver(
                client, GenerateOutput(rid, [2], "b", True, "length", usage=usage), None
            )
            del fe.by_client[(client, rid)]
            return await serving

        seen.clear()
        assert asyncio.run(run()) == ["streamed"] and seen == [4], is_off_loop
        assert not server.prompt_lens  # forgotten with its stream


def test_a_whole_reply_of_several_choices_is_bounded_in_output_logprobs(make_frontend):
    """Found by a hunt: a whole (not streamed) batch of 64 prompts x 4 choices x 1,000
    tokens with 20 logprobs each held every token's logprobs to its end (0.5 GB of the
    frontend's memory, a 97 MB reply, the loop held up to 2 s). Its output logprobs are
    counted before any work, as its prompt logprobs are: past the bound, a 400 naming it;
    a stream, or one choice of one prompt, is not held to it."""
    fe = make_frontend()  # no node: a request let through is refused there (a 503)
    many = {"prompt": ["a"] * 64, "max_tokens": 1000, "logprobs": 20, "n": 4}
    status, body = _post(fe, many)
    assert status == 400 and "n x max_tokens x (logprobs + 1)" in body["error"]["message"]
    for fine in ({**many, "prompt": "a", "n": 1}, {**many, "max_tokens": 100}):
        status, body = _post(fe, fine)
        assert status == 503, body


def test_tokenizes_ids_are_written_a_piece_at_a_time(make_frontend):
    """Found by a hunt: /tokenize answered a text's ids, any number of them (262,144 for
    64 Ki emoji, 256 times the tiny model's length), encoded in one piece on the loop. They
    are encoded as a whole answer is, the loop taking turns between the pieces."""
    from frontend.http import HttpServer

    fe = make_frontend()
    server = HttpServer(fe, "m")
    turns = [0]

    async def count_turns():
        while True:
            turns[0] += 1
            await asyncio.sleep(0)

    async def run():
        text = "\U0001f642" * 65536  # on the loop (not past OFF_LOOP_CHARS)
        other = asyncio.create_task(count_turns())
        await asyncio.sleep(0)
        start = turns[0]
        response = await server.tokenize(_Post({"model": "m", "prompt": text}))
        other.cancel()
        return response, turns[0] - start

    response, num_turns = asyncio.run(run())
    body = json.loads(response.body)
    assert body["count"] == len(body["tokens"]) > 65536 and num_turns > 10
