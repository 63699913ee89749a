"""What a group of requests (an HTTP batch of prompts) and a chat template's variables may
cost the frontend, checked before the work they would cause: prompt logprobs over every
choice of every prompt of a reply, a client's batches being tokenized at once, template
variables counted as prompt text. In this process, on the frontend's own classes."""

from __future__ import annotations

import asyncio

from common.wire.protocol import GenerateRequest
from frontend.prompts import OFF_LOOP_CHARS, text_len
from frontend.reply_cost import MAX_REPLY_LOGPROBS
from tests.unit import test_intake
from tests.unit.test_intake import CLIENT, _error, _settled, _submit

# test_intake's frontend fixture, under its own name: pytest finds fixtures among a module's
# names, and each test's argument `make_frontend` asks for it.
make_frontend = test_intake.make_frontend


def test_the_prompt_logprobs_every_choice_replies_with_are_bounded_before_any_work(make_frontend):
    """Every choice's reply holds the prompt's logprobs: n x the prompt x (prompt_logprobs + 1)
    of them (64 x 900 x 6: ~346k, 0.4 s of the frontend's loop to shape and write). Refused
    with a 400 naming the product and the limit, before the request reaches a node."""
    from frontend.reply_cost import MAX_REPLY_LOGPROBS

    fe = make_frontend(64)
    prompt = [(7 * i) % 400 + 1 for i in range(900)]
    (reply,) = _submit(
        fe, GenerateRequest("a", prompt_token_ids=prompt, max_tokens=1, n=64, prompt_logprobs=20)
    )
    error, status = _error(reply)
    assert status == 400 and str(MAX_REPLY_LOGPROBS) in error and "prompt_logprobs" in error, error
    assert not fe.requests
    _submit(
        fe, GenerateRequest("b", prompt_token_ids=prompt, max_tokens=1, n=16, prompt_logprobs=5)
    )
    assert len(fe.requests) == 16  # 16 x 900 x 6 fits
    _submit(fe, GenerateRequest("c", prompt_token_ids=prompt, max_tokens=1, prompt_logprobs=20))
    assert len(fe.requests) == 17  # one choice: its one copy, whatever its size


def test_a_batchs_prompt_logprobs_are_bounded_over_all_its_prompts(make_frontend):
    """Defect: the bound on a reply's prompt logprobs was checked per request and only for
    n > 1, but a batch of prompts is one reply: 256 prompts of 390 tokens, n=16,
    prompt_logprobs=20 held 33.5M logprobs (0.8 GB of JSON, ~40 s of the frontend's loop),
    each request just under the bound. The batch is refused whole with a 400."""
    fe = make_frontend(64)
    prompt = [(7 * i) % 400 + 1 for i in range(390)]
    batch = [
        GenerateRequest(f"p{i}", prompt_token_ids=prompt, max_tokens=1, n=16, prompt_logprobs=20)
        for i in range(2)
    ]

    async def run(reqs):
        await fe.submit_group(CLIENT, reqs)
        await _settled(fe)

    asyncio.run(run(batch))
    assert len(fe.replies) == 2 and not fe.requests
    error, status = _error(fe.replies[0])
    assert status == 400 and "over the prompts" in error and str(MAX_REPLY_LOGPROBS) in error
    fe.replies.clear()
    ones = [
        GenerateRequest(f"q{i}", prompt_token_ids=prompt, max_tokens=1, prompt_logprobs=20)
        for i in range(17)
    ]  # n=1 each: 17 x 390 x 21 = 139,230, one reply
    asyncio.run(run(ones))
    assert len(fe.replies) == 17 and all(_error(r)[1] == 400 for r in fe.replies)
    fe.replies.clear()
    asyncio.run(run(ones[:15]))  # 124,110: within
    assert not fe.replies and len(fe.requests) == 15


def test_a_clients_batches_being_tokenized_at_once_are_bounded(make_frontend):
    """Defect: each pending batch tokenizes one prompt every loop turn, and nothing bounded
    how many batches one client had pending: 64 batches of two 60 KB prompts held every
    other stream 1.2 s between turns (23 ms with one). A client's fifth batch while four
    are tokenized is refused with a 429 before any of it is read; a finished one frees
    its place."""
    from frontend.intake import MAX_GROUPS_PER_CLIENT

    fe = make_frontend(64)
    gate = asyncio.Event()
    prepare = fe.prompts.now

    async def run():
        async def held_prepare(client, reqs):  # every batch waits at its first prompt
            await gate.wait()
            return [prepare(r) for r in reqs]

        fe.intake._prepare = held_prepare
        for g in range(MAX_GROUPS_PER_CLIENT + 1):
            await fe.submit_group(
                CLIENT, [GenerateRequest(f"g{g}-{i}", prompt="hi", max_tokens=2) for i in range(2)]
            )
        await fe.submit_group(
            ("http", "other"),
            [GenerateRequest(f"o{i}", prompt="hi", max_tokens=2) for i in range(2)],
        )
        refused = [(m.request_id, s) for m, s in fe.replies]
        gate.set()
        await _settled(fe)
        await fe.submit_group(
            CLIENT, [GenerateRequest(f"late-{i}", prompt="hi", max_tokens=2) for i in range(2)]
        )
        await _settled(fe)
        return refused

    refused = asyncio.run(run())
    last = MAX_GROUPS_PER_CLIENT
    assert refused == [(f"g{last}-0", 429), (f"g{last}-1", 429)], refused
    assert "batches" in _error(fe.replies[0])[0]
    started = {rid for _, rid in fe.by_client}
    assert {f"g{g}-{i}" for g in range(last) for i in range(2)} <= started
    assert {"o0", "o1", "late-0", "late-1"} <= started and not fe.intake.num_groups


def test_a_chat_templates_variables_count_as_the_prompts_text():
    """Defect: chat_template_kwargs were not counted in a request's text: a template that
    prints one (Llama 3's date_string) rendered and tokenized 1.9 MB on the frontend's loop
    (2.4 s) for a request counted as 33 characters. They count now, so such a request goes
    off the loop (and is refused unread past the model's length)."""
    big = {"date_string": "x" * (OFF_LOOP_CHARS + 1)}
    req = GenerateRequest(
        "a", messages=[{"role": "user", "content": "hi"}], max_tokens=2, chat_template_kwargs=big
    )
    assert text_len(req) > OFF_LOOP_CHARS
    plain = GenerateRequest("b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert text_len(plain) < 100


def test_a_request_cancelled_before_its_work_begins_is_answered_and_its_id_freed(make_frontend):
    """Defect: a ZeroMQ client's request tokenized off the loop and its abort, read in the
    same turn, cancelled the request's task before its first step: its body, which answers
    the client and frees the id, never ran. The stream hung, the id stayed taken (refused
    as a duplicate for good), and the pending table grew with each such pair."""
    fe = make_frontend(16)
    fe.prompts.is_off_loop = lambda req: True  # as a long prompt or a grammar is

    async def run():
        await fe.submit(CLIENT, GenerateRequest("r", prompt="hi", max_tokens=2))
        assert fe.intake.cancel((CLIENT, "r"))  # before the task has run at all
        await _settled(fe)
        await asyncio.sleep(0.05)
        answered = list(fe.replies)
        await fe.submit(CLIENT, GenerateRequest("r", prompt="hi", max_tokens=2))
        await _settled(fe)
        return answered

    answered = asyncio.run(run())
    ((msg, _),) = answered
    assert msg.request_id == "r" and msg.finish_reason == "abort" and "cancelled" in msg.error
    assert not fe.intake._aborted and (CLIENT, "r") in fe.by_client  # the id served again
