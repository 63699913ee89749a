"""What real clients send, through the official openai client and the ZeroMQ client
against a cluster: logprobs and echo against transformers (with a prefix-cache hit
too), n choices each equal to the request alone with seed + i, penalties equal to
the worker's own, structured outputs valid on every prompt of a random model, tool
calls, reasoning, and the errors for what cannot be served."""

from __future__ import annotations

import json
import re
import time

import openai
import pytest
import torch

from common.base.request import SamplingParams
from frontend.client import Client
from tests.cluster_util import Cluster, post_json, wait_for

MODEL = "tiny"
PROMPT = [
    5,
    17,
    99,
    3,
    250,
    41,
    8,
    77,
    12,
    33,
    120,
    7,
    64,
    2,
    19,
    88,
    101,
]  # 17 tokens: a full block and one


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("api") / "c.log",
        "--served-model-name",
        MODEL,
        "--reasoning-parser",
        "qwen3",
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster.http + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


def _logp(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


# ---- logprobs and echo ---------------------------------------------------------------


def test_completion_logprobs_equal_transformers(oai, hf, cluster):
    r = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True},
    )
    c = r.choices[0]
    out = c.model_extra["token_ids"]
    logp = _logp(hf, PROMPT + out)
    assert len(c.logprobs.token_logprobs) == 6
    for i, (tok, lp, top) in enumerate(
        zip(out, c.logprobs.token_logprobs, c.logprobs.top_logprobs)
    ):
        ref = logp[len(PROMPT) - 1 + i]
        assert lp == pytest.approx(ref[tok].item(), abs=1e-4)
        # By text: tokens of one text are one entry, the likelier (the ids are compared below).
        assert max(top.values()) == pytest.approx(ref.max().item(), abs=1e-4)
        assert all(
            any(abs(v - x) < 1e-4 for x in ref.topk(3).values.tolist() + [lp]) for v in top.values()
        )
    with Client(cluster.endpoint) as zc:
        r = zc.complete(prompt_token_ids=PROMPT, max_tokens=6, logprobs=3)
    for i, x in enumerate(r.logprobs):
        ref = logp[len(PROMPT) - 1 + i]
        assert x.top_ids == ref.topk(3).indices.tolist()
        assert x.top_logprobs == pytest.approx(ref.topk(3).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("is_cached", [False, True], ids=["cold", "prefix-cache-hit"])
def test_echo_gives_the_prompts_logprobs_with_or_without_a_cache_hit(oai, hf, is_cached):
    """What evaluation harnesses send: echo with logprobs and max_tokens 0."""
    prompt = PROMPT + [3, 4, 5] if is_cached else PROMPT
    if is_cached:  # its first block is in the prefix cache now
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    logp = _logp(hf, prompt)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(logp[i - 1, prompt[i]].item(), abs=1e-4)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"


def test_chat_logprobs_have_openai_shape(oai, hf):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert (
            isinstance(item.token, str)
            and isinstance(item.bytes, list)
            and len(item.top_logprobs) == 2
        )
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= -9999


def test_streamed_logprobs_come_with_their_tokens(oai):
    chunks = list(
        oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, stream=True
        )
    )
    lps = [
        x
        for c in chunks
        for x in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])
    ]
    whole = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0
    )
    assert lps == pytest.approx(whole.choices[0].logprobs.token_logprobs)


# ---- n choices, and the sampling controls ----------------------------------------------------


def _figure(cluster, node: str, key: str) -> int:
    return cluster.stats()[node].get(key, 0)


def _settled(cluster) -> list[int]:
    """Handoffs of prefill-0 and sequences forked on decode-0, from figures taken after
    this call (stats_at): they count every request that ended before it."""
    t0 = time.time()

    def fresh():
        nodes = cluster.stats()
        if all(nodes[n].get("stats_at", 0) > t0 for n in ("prefill-0", "decode-0")):
            return [
                nodes["prefill-0"].get("num_handoffs", 0),
                nodes["decode-0"].get("num_forked", 0),
            ]

    return wait_for(fresh, 10, "each node's figures taken after the earlier requests ended")


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:16]], ids=["partial-block", "full-blocks"])
def test_n_choices_each_equal_the_request_alone_with_seed_plus_i(oai, cluster, prompt):
    """One prefill for all n, then n sequences over the prompt's blocks on the decode node."""
    before = _settled(cluster)
    r = oai.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0.9,
        seed=40,
        n=4,
        logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    wait_for(
        lambda: (
            [
                _figure(cluster, "prefill-0", "num_handoffs"),
                _figure(cluster, "decode-0", "num_forked"),
            ]
            == [before[0] + 1, before[1] + 3]
        ),
        10,
        "one handoff of the prompt, three sequences forked from it",
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, c in enumerate(r.choices):
        alone = oai.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0.9,
            seed=40 + i,
            logprobs=2,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        assert c.model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
        assert c.logprobs.token_logprobs == pytest.approx(
            alone.choices[0].logprobs.token_logprobs, abs=1e-5
        )
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) > 1
    assert r.usage.completion_tokens == 4 * 8
    streamed = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            n=2,
            stream=True,
            seed=1,
            temperature=1.0,
        )
    )
    assert {c.choices[0].index for c in streamed if c.choices and c.choices[0].finish_reason} == {
        0,
        1,
    }


def test_penalties_and_bias_through_the_api_equal_the_workers(oai, cluster, tiny_model):
    from common.base.config import WorkerConfig
    from common.engine.worker import DeviceWorker
    from launch.tools.offline import generate

    body = dict(presence_penalty=1.5, frequency_penalty=0.75, logit_bias={"7": 3.0, "11": -100})
    r = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={
            "return_token_ids": True,
            "repetition_penalty": 1.25,
            "min_tokens": 3,
            "ignore_eos": True,
        },
        **body,
    )
    p = SamplingParams(
        max_tokens=10,
        ignore_eos=True,
        presence_penalty=1.5,
        frequency_penalty=0.75,
        repetition_penalty=1.25,
        min_tokens=3,
        logit_bias_ids=(7, 11),
        logit_bias=(3.0, -100.0),
    )
    with DeviceWorker(WorkerConfig(model=str(tiny_model), kv_cache_memory=2**20)) as w:
        want = generate(w, [PROMPT], [p])[0]["token_ids"]
    assert r.choices[0].model_extra["token_ids"] == want


def test_bad_words_are_never_completed(oai, tiny_model):
    """A word of two tokens that the greedy output holds: asked as a bad word, neither its
    spelling nor its spelling after a space appears, and the output goes another way."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    extra = {"return_token_ids": True, "ignore_eos": True}
    out = (
        oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra
        )
        .choices[0]
        .model_extra["token_ids"]
    )

    def words(n: int) -> list[str]:  # n tokens of the output that are a word of their own
        return [
            tok.decode(out[k : k + n])
            for k in range(len(out) - n + 1)
            if tok.encode(tok.decode(out[k : k + n]), add_special_tokens=False) == out[k : k + n]
        ]

    assert words(2) and words(1), "the output has no word of one and of two tokens"
    for word in (words(2)[0], words(1)[0]):
        got = (
            oai.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=16,
                temperature=0,
                extra_body={**extra, "bad_words": [word]},
            )
            .choices[0]
            .model_extra["token_ids"]
        )
        assert got != out
        for spelling in {word, word if word.startswith(" ") else " " + word}:
            ids = tok.encode(spelling, add_special_tokens=False)
            assert not any(got[i : i + len(ids)] == ids for i in range(len(got))), (word, ids, got)


def test_the_zmq_client_gets_logprobs_and_choices(cluster):
    with Client(cluster.endpoint) as c:
        r = c.complete(
            prompt_token_ids=PROMPT,
            max_tokens=4,
            logprobs=2,
            n=2,
            temperature=0.5,
            seed=3,
            prompt_logprobs=1,
        )
    assert len(r.choices) == 2 and all(
        len(x.logprobs) == 4 and x.finish_reason == "length" for x in r.choices
    )
    assert len(r.prompt_logprobs) == len(PROMPT) - 1 and r.choices[1].prompt_logprobs is not None


# ---- structured outputs ---------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _valid(obj: dict) -> bool:
    return (
        set(obj) == {"name", "age", "tags"}
        and isinstance(obj["name"], str)
        and len(obj["name"]) <= 12
        and isinstance(obj["age"], int)
        and 0 <= obj["age"] <= 150
        and len(obj["tags"]) <= 3
        and all(t in ("a", "b", "c") for t in obj["tags"])
    )


def test_json_schema_outputs_are_valid_on_fifty_prompts(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for i in range(50):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"person {i}"}],
            max_tokens=120,
            temperature=1.0,
            seed=i,
            response_format=fmt,
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        assert _valid(json.loads(text)), text
        assert json.dumps(json.loads(text), ensure_ascii=False) == text  # no free whitespace


def test_json_object_regex_and_choice_hold(oai):
    for i in range(50):
        obj = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": str(i)}],
            max_tokens=60,
            temperature=1.0,
            seed=i,
            response_format={"type": "json_object"},
        )
        assert obj.choices[0].finish_reason != "stop" or isinstance(
            json.loads(obj.choices[0].message.content), dict
        )
        rx = oai.completions.create(
            model=MODEL,
            prompt=f"{i}",
            max_tokens=20,
            temperature=1.0,
            seed=i,
            n=3,
            extra_body={"guided_regex": r"[a-c]{2,5}-[0-9]{3}"},
        )
        for c in rx.choices:  # n sequences forked after one prefill: each its own matcher
            assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", c.text), c.text
        ch = oai.completions.create(
            model=MODEL,
            prompt=f"{i}",
            max_tokens=10,
            temperature=1.0,
            seed=i,
            extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
        )
        assert ch.choices[0].text in ("red", "green", "blue")


def test_a_schema_that_does_not_compile_is_a_400_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        )
    assert "json_schema" in e.value.body["message"]


# ---- tools and reasoning ------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "days": {"type": "integer"},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "add"}}],
    ids=["required", "named"],
)
def test_a_forced_tool_choice_gives_calls_with_valid_arguments(oai, choice):
    """One call (parallel_tool_calls false): a random model's list of calls never ends.
    A random model's integers may run long, so a call cut by max_tokens is allowed,
    but not most of them."""
    num_whole = 0
    for i in range(10):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"go {i}"}],
            max_tokens=160,
            temperature=1.0,
            seed=i,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
        )
        m = r.choices[0].message
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == 160
            if choice != "required" or not m.tool_calls:
                continue
        else:
            assert r.choices[0].finish_reason == "tool_calls"
            num_whole += 1
        assert m.tool_calls, m
        for call in m.tool_calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "add":
                assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
            else:
                assert call.function.name == "get_weather" and isinstance(args["city"], str)
        assert len(m.tool_calls) == 1
        if isinstance(choice, dict):
            assert [c.function.name for c in m.tool_calls] == ["add"]
    assert num_whole >= 6


def test_parallel_required_calls_cut_by_max_tokens_keep_the_whole_ones(oai):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go 0"}],
        max_tokens=80,
        temperature=1.0,
        seed=0,
        tools=TOOLS,
        tool_choice="required",
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 80
    calls = r.choices[0].message.tool_calls
    assert calls and all(isinstance(json.loads(c.function.arguments), dict) for c in calls)


def test_tool_calls_stream_as_deltas(oai):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=80,
            seed=2,
            temperature=1.0,
            tools=TOOLS,
            parallel_tool_calls=False,
            tool_choice="required",
            stream=True,
        )
    )
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert calls and all(json.loads(d.function.arguments) is not None for d in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tools_reach_the_chat_template(oai, cluster, tiny_model):
    """The prompt holds the tools (its length says so), and a tool's answer goes back in."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    r = oai.chat.completions.create(
        model=MODEL,
        messages=msgs,
        tools=TOOLS,
        max_tokens=2,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    want = tok.apply_chat_template(
        [
            msgs[0],
            {
                **msgs[1],
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Oslo", "days": 1},
                        },
                    }
                ],
            },
            msgs[2],
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        enable_thinking=False,
    )
    assert r.usage.prompt_tokens == len(want["input_ids"] if hasattr(want, "keys") else want)


# ---- the small ones: /tokenize, cached tokens, usage on every chunk, errors ------------

_post = post_json


def oai_max_len(cluster) -> int:
    import urllib.request

    with urllib.request.urlopen(cluster.http + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["max_model_len"]


def test_tokenize_and_detokenize_round_trip(cluster, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    status, r = _post(cluster.http + "/tokenize", {"model": MODEL, "prompt": "the water is hot"})
    assert status == 200 and r["tokens"] == tok.encode("the water is hot")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == oai_max_len(cluster)
    msgs = [{"role": "user", "content": "hi there"}]
    status, r = _post(cluster.http + "/tokenize", {"messages": msgs})
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert status == 200 and r["tokens"] == list(
        want["input_ids"] if hasattr(want, "keys") else want
    )
    status, r = _post(cluster.http + "/detokenize", {"tokens": tok.encode("the water is hot")})
    assert status == 200 and r["prompt"] == "the water is hot"
    # Refusals in OpenAI's shape, the routes' own and aiohttp's alike.
    for url, body, want_status, param in [
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": "x"}, 400, "tokens"),
        ("/tokenize", {"prompt": "a", "messages": msgs}, 400, None),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", b"{not json", 400, None),
        ("/v1/no-such-route", {}, 404, None),
    ]:
        status, r = _post(cluster.http + url, body)
        assert status == want_status and isinstance(r["error"]["message"], str), (url, r)
        assert r["error"]["param"] == param and r["error"]["code"] == want_status
    status, r = _post(cluster.http + "/v1/completions", b"", method="GET")
    assert status == 405 and "GET /v1/completions" in r["error"]["message"]


def test_usage_counts_prefix_cache_hits(oai):
    prompt = [7, 7] + PROMPT[2:] + [9] * 16  # 33 tokens: two full blocks, unseen so far
    cold = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    hit = oai.completions.create(
        model=MODEL, prompt=prompt[:32] + [4, 4], max_tokens=2, temperature=0
    )
    assert hit.usage.prompt_tokens_details.cached_tokens == 32 and hit.usage.prompt_tokens == 34
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(oai):
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    with_text = [c for c in chunks if c.choices and c.choices[0].text]
    assert with_text and all(
        c.usage is not None and c.usage.prompt_tokens == len(PROMPT) for c in chunks
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].choices == []
    plain = list(
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 6


def test_a_whole_grammar_with_ignore_eos_runs_on_to_max_tokens(oai, cluster):
    """Once the grammar is whole only EOS may follow; ignore_eos asks for max_tokens
    all the same: EOS tokens (not shown) fill the rest, and no node fails the request
    as one whose tokens its grammar refuses."""
    r = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].text in ("yes", "no") and r.usage.completion_tokens == 12


def test_vllms_extras_at_their_defaults_are_taken_and_otherwise_refused(cluster):
    extras = {
        "add_generation_prompt": True,
        "include_stop_str_in_output": False,
        "spaces_between_special_tokens": True,
        "skip_special_tokens": True,
    }
    status, r = _post(
        cluster.http + "/v1/chat/completions",
        # NOTE: ignore_eos, else a sampled EOS on some CPU's rounding ends it at one token.
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True}
        | extras,
    )
    assert status == 200 and r["usage"]["completion_tokens"] == 2
    status, r = _post(cluster.http + "/tokenize", {"prompt": "hi", "add_special_tokens": True})
    assert status == 200 and r["count"] > 0
    status, r = _post(
        cluster.http + "/v1/completions", {"prompt": "hi", "include_stop_str_in_output": True}
    )
    assert status == 400 and r["error"]["param"] == "include_stop_str_in_output"


def test_a_batch_of_prompts_is_answered_as_each_alone(oai):
    """What lm-eval's local-completions sends with batch_size > 1: choice i of prompt k at
    k * n + i, each equal to its prompt sent alone; usage summed."""
    prompts = [PROMPT, [9, 8, 7, 6], "the water is hot"]
    r = oai.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=5,
        temperature=0.8,
        seed=4,
        n=2,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == list(range(6))
    total = 0
    for k, p in enumerate(prompts):
        alone = oai.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=5,
            temperature=0.8,
            seed=4,
            n=2,
            logprobs=1,
            echo=True,
            extra_body={"ignore_eos": True},
        )
        for i in range(2):
            got, want = r.choices[k * 2 + i], alone.choices[i]
            assert got.text == want.text and got.logprobs.tokens == want.logprobs.tokens
        total += alone.usage.prompt_tokens
    assert r.usage.prompt_tokens == total and r.usage.completion_tokens == 3 * 2 * 5


def test_malformed_tool_choices_get_a_400_naming_tools(cluster):
    for choice in [{"type": "function", "function": "add"}, {"function": None}, "always", 3]:
        status, r = _post(
            cluster.http + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": choice},
        )
        assert status == 400 and r["error"]["param"] == "tools", (choice, r)
