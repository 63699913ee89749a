"""A whole reply's logprobs as frontend/answers.Answer gathers them, in process: a decode
node's steps send a token at a time, and the answer equals its logprobs shaped at once."""

from __future__ import annotations

import types

import pytest

from common.base.request import TokenLogprobs
from frontend import openai_api as api
from frontend import openai_logprobs as lp
from frontend.answers import Answer

TOP = 3


class _Tokenizer:
    """Token i is the text "t<i>": enough for TokenStrings, without a model."""

    def convert_ids_to_tokens(self, i: int) -> str:
        return f"t{i}"

    def convert_tokens_to_string(self, pieces: list[str]) -> str:
        return "".join(pieces)


def _logprobs(i: int) -> TokenLogprobs:
    return TokenLogprobs(
        -1.0 - i / 100, [i + j for j in range(TOP)], [-1.0 - j for j in range(TOP)]
    )


def _msg(i: int, prompt_ids: list[int] | None = None, prompt_lps: list | None = None):
    return types.SimpleNamespace(
        text=f"t{i}",
        token_ids=[i],
        logprobs=[_logprobs(i)],
        prompt_token_ids=prompt_ids,
        prompt_logprobs=prompt_lps,
        is_finished=False,
    )


def _call(kind: str, **extra) -> api.Call:
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": TOP}
    body = chat if kind == "chat" else {"prompt": "hi", "logprobs": TOP}
    return api.parse({**body, **extra}, kind, "m", 16)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_whole_answers_logprobs_are_extended_in_place_not_rebuilt(kind):
    """Defect: Answer.add rebuilt every logprob list gathered so far on each update (a
    merge copied them all), so a non-streamed choice of T tokens cost O(T^2) on the
    frontend's one loop: 8,000 tokens took 0.28 s, 32,000 about 4.5 s, times n. The
    lists are now extended in place: the same list objects from the first token to the
    last, and the answer equals its logprobs shaped at once, byte for byte."""
    strings = lp.TokenStrings(_Tokenizer())
    answer = Answer(_call(kind), strings, "")
    ids = list(range(5, 2005))
    answer.add(_msg(ids[0]))
    first = {k: v for k, v in answer.logprobs.items()}
    for i in ids[1:]:
        answer.add(_msg(i))
    assert all(answer.logprobs[k] is v for k, v in first.items()), "the lists were rebuilt"
    lps = [_logprobs(i) for i in ids]
    whole = lp.chat(strings, ids, lps) if kind == "chat" else lp.completion(strings, ids, lps)
    assert answer.logprobs == whole
    assert answer.choice("length")[3] == whole


def test_choices_extending_their_logprobs_leave_the_shared_prompt_part_alone():
    """With echo the prompt's part is made once and shared by a call's choices: each
    choice's own lists start as a copy, so extending one choice's leaves the others'."""
    strings = lp.TokenStrings(_Tokenizer())
    call = _call("completions", echo=True, n=2)
    shared: dict = {}
    answers = [Answer(call, strings, "hi", prompt_parts=shared) for _ in range(2)]
    prompt_ids, prompt_lps = [1, 2, 3], [_logprobs(2), _logprobs(3)]
    for a, first in zip(answers, (10, 20)):
        a.add(_msg(first, prompt_ids, prompt_lps))
        for i in range(first + 1, first + 4):
            a.add(_msg(i))
    (part,) = shared.values()
    assert part == lp.completion(strings, prompt_ids, [None, *prompt_lps])
    for a, first in zip(answers, (10, 20)):
        ids = prompt_ids + list(range(first, first + 4))
        lps = [None, *prompt_lps, *(_logprobs(i) for i in range(first, first + 4))]
        assert a.logprobs == lp.completion(strings, ids, lps)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_streamed_answer_keeps_no_text_or_logprobs_it_has_sent(kind):
    """Found by a hunt: a streamed choice kept every token's logprobs (kilobytes a token
    with 20 alternatives) and its text to its end, though only a whole response reads them:
    n=64 long choices held gigabytes. A stream's answer hands each update's out and keeps
    only its token ids (the usage counts them); a whole one keeps all, as before."""
    strings = lp.TokenStrings(_Tokenizer())
    streamed, whole = (
        Answer(_call(kind, stream=True), strings, ""),
        Answer(_call(kind), strings, ""),
    )
    for i in range(5, 505):
        sent = streamed.add(_msg(i))
        assert sent[0] == f"t{i}" and sent[1] is not None  # each update's own, handed out
        whole.add(_msg(i))
    assert streamed.logprobs is None and streamed.text == [] and len(streamed.token_ids) == 500
    assert whole.logprobs is not None and "".join(whole.text).endswith("t504")
