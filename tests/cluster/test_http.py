"""The OpenAI-compatible HTTP API and /metrics, end to end through start_cluster.sh,
with the official openai client: tokens equal transformers' greedy tokens; SSE
chunks parse and end with [DONE]; usage is right; errors have OpenAI's shape and
the documented status; a dropped stream frees every block; metrics move by the
right amounts."""

from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.cluster_util import Cluster, Processes, free_base_port, post_json, wait_for
from tests.conftest import hf_greedy

MODEL_NAME = "tiny-served"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    # vLLM's flag names, as users bring them.
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("logs") / "http.log",
        "--served-model-name",
        MODEL_NAME,
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "512",
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=cluster.http + "/v1", api_key="unused", max_retries=0, timeout=60)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except urllib.error.URLError:  # not listening yet
        return 0, b""


_post = post_json


def _blocks_free(cluster) -> bool:
    return all(
        s["num_free_blocks"] == s["num_usable_blocks"] and not s.get("num_reserved_blocks")
        for s in cluster.stats().values()
    )


def test_models_lists_the_served_name_with_the_vllm_style_limits(cluster, oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == 512
    batch = {s["role"]: s for s in cluster.stats().values()}["decode"]
    assert batch["max_batch_size"] == 8


def test_completions_streamed_and_not_equal_transformers(oai, tiny_model):
    prompts = [[5, 17, 99, 3], list(range(40, 75))]
    expected = hf_greedy(tiny_model, prompts, NEW_TOKENS)
    for ids, want in zip(prompts, expected):
        r = oai.completions.create(
            model=MODEL_NAME,
            prompt=ids,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == want and choice.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            len(ids),
            NEW_TOKENS,
            len(ids) + NEW_TOKENS,
        )
        assert r.id.startswith("cmpl-") and r.object == "text_completion"
        chunks = list(
            oai.completions.create(
                model=MODEL_NAME,
                prompt=ids,
                max_tokens=NEW_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        )
        streamed = [t for c in chunks for ch in c.choices for t in ch.model_extra["token_ids"]]
        assert streamed == want
        assert "".join(ch.text for c in chunks for ch in c.choices) == choice.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW_TOKENS
        assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == [
            "length"
        ]


def test_chat_streamed_and_not_equal_transformers(oai, tiny_model):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_greedy(tiny_model, [ids], NEW_TOKENS)[0]
    r = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == NEW_TOKENS
    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seed_and_stop_strings(oai):
    def sample(seed):
        r = oai.completions.create(
            model=MODEL_NAME,
            prompt="Once",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return r.choices[0]

    a, b, c = sample(7), sample(7), sample(8)
    assert a.model_extra["token_ids"] == b.model_extra["token_ids"] != c.model_extra["token_ids"]
    full = (
        oai.completions.create(
            model=MODEL_NAME,
            prompt="Once",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[3:5]
    cut = oai.completions.create(
        model=MODEL_NAME,
        prompt="Once",
        max_tokens=16,
        temperature=0,
        stop=[stop, "never seen"],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_sse_events_parse_and_end_with_done(cluster):
    host, port = cluster.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {"prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
        ),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    events = [e for e in r.read().decode().split("\n\n") if e]
    conn.close()
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert {b["object"] for b in bodies} == {"text_completion"}
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
        ({"prompt": "hi", "suffix": "!"}, 400, "suffix"),
        (
            {"prompt": "hi", "max_tokens": 0},
            400,
            "max_tokens",
        ),  # the prompt alone needs echo + logprobs
        ({"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
        (
            {
                "prompt": "hi",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                },
            },
            400,
            None,
        ),  # a schema that does not compile
        ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
        ({"prompt": "hi", "stop": ["\n", ""]}, 400, "stop"),
        ({"prompt": ["a", "b"], "stream": True}, 400, "prompt"),  # a batch is answered whole
        ({"prompt": ["a", 5]}, 400, "prompt"),
        ({"prompt": list(range(600)), "max_tokens": 4}, 400, None),  # past --max-model-len 512
        ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ],
)
def test_bad_requests_get_openai_errors(cluster, body, status, param):
    code, reply = _post(cluster.http + "/v1/completions", {"model": MODEL_NAME, **body})
    assert code == status
    err = reply["error"]
    assert err["code"] == status and err["param"] == param and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_unsupported_parameter_through_the_openai_client(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, suffix="!")
    assert "'suffix' is not supported" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


def test_a_dropped_stream_frees_every_block(cluster):
    wait_for(lambda: _blocks_free(cluster), 30, "an idle cluster")
    before = _metrics(cluster)
    host, port = cluster.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "prompt": list(range(1, 11)),
                "max_tokens": 500,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")  # it is decoding ...
    conn.sock.close()  # ... and the client goes away
    conn.close()
    key = ("pdserve_requests_finished_total", (("reason", "abort"),))
    wait_for(
        lambda: _metrics(cluster).get(key, 0) == before.get(key, 0) + 1, 30, "the request aborted"
    )
    after = _metrics(cluster)
    generated = (
        after[("pdserve_generation_tokens_total", ())]
        - before[("pdserve_generation_tokens_total", ())]
    )
    assert generated < 500  # stopped early, not run to max_tokens
    wait_for(lambda: _blocks_free(cluster), 30, "every block freed after the client left")


def _metrics(cluster) -> dict:
    status, text = _get(cluster.http + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _on_prefill(m: dict, name: str) -> float:
    return sum(
        v for (n, labels), v in m.items() if n == name and dict(labels).get("node") == "prefill-0"
    )


def _transfers_settled(cluster) -> bool:
    """The KV write counts (from heartbeats, 0.5 s apart) hold still: earlier writes are in."""
    first = _on_prefill(_metrics(cluster), "pdserve_kv_transfers_total")
    time.sleep(0.6)
    return _on_prefill(_metrics(cluster), "pdserve_kv_transfers_total") == first


def test_metrics_parse_and_move_by_the_right_amounts(cluster, oai):
    wait_for(lambda: _transfers_settled(cluster), 10, "the KV write counts to settle")
    before = _metrics(cluster)
    lengths = [(7, 3), (20, 5), (33, 9)]
    for prompt_len, max_tokens in lengths:
        oai.completions.create(
            model=MODEL_NAME,
            prompt=list(range(1, prompt_len + 1)),
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    after = _metrics(cluster)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("pdserve_requests_finished_total", reason="length") == 3
    assert moved("pdserve_prompt_tokens_total") == sum(p for p, _ in lengths)
    assert moved("pdserve_generation_tokens_total") == sum(t for _, t in lengths)
    for h in (
        "pdserve_time_to_first_token_seconds",
        "pdserve_e2e_request_latency_seconds",
        "pdserve_time_per_output_token_seconds",
        "pdserve_kv_transfer_seconds",
    ):
        assert moved(h + "_count") == 3, h
    assert after[("pdserve_requests_running", ())] == 0
    nodes = {dict(k[1])["node"]: v for k, v in after.items() if k[0] == "pdserve_node_is_alive"}
    assert nodes == {"prefill-0": 1.0, "decode-0": 1.0}
    assert after[("pdserve_node_kv_blocks_free", (("node", "decode-0"), ("role", "decode")))] > 0
    assert ("pdserve_node_prefix_hit_rate", (("node", "prefill-0"), ("role", "prefill"))) in after
    # KV transfers per prefill node and backend, from its heartbeats (a beat behind).
    wait_for(
        lambda: (
            _on_prefill(_metrics(cluster), "pdserve_kv_transfers_total")
            == _on_prefill(before, "pdserve_kv_transfers_total") + 3
        ),
        5,
        "the KV transfers counted",
    )
    late = _metrics(cluster)
    for name, moved_by in (
        ("pdserve_kv_write_seconds_count", 3),
        ("pdserve_kv_transfer_failures_total", 0),
    ):
        assert _on_prefill(late, name) == _on_prefill(before, name) + moved_by, name
    assert _on_prefill(late, "pdserve_kv_transfer_bytes_total") > _on_prefill(
        before, "pdserve_kv_transfer_bytes_total"
    )
    # --kv-layerwise auto: prompts this short go whole (the counter is there, and still)
    assert (
        "pdserve_kv_layerwise_transfers_total",
        (("backend", "ipc"), ("node", "prefill-0")),
    ) in late
    assert _on_prefill(late, "pdserve_kv_layerwise_transfers_total") == 0
    assert _on_prefill(late, "pdserve_kv_chunked_transfers_total") == 0
    assert _on_prefill(late, "pdserve_kv_write_rate_bytes_per_second") == 0  # no write of 1 MiB yet
    # The frontend process's own cost, as every Prometheus exporter names it.
    assert after[("process_resident_memory_bytes", ())] > 10 * 2**20
    assert after[("process_cpu_seconds_total", ())] >= before[("process_cpu_seconds_total", ())] > 0


@pytest.mark.cluster
def test_health_deadline_and_a_dead_decode_node(tiny_model, tmp_path):
    """504 when the request's deadline passes; 503 with OpenAI's error body once no
    prefill/decode pair is alive."""
    base = free_base_port(4)
    procs = Processes(
        tiny_model,
        base,
        tmp_path,
        frontend=[
            "--http-port",
            str(base + 3),
            "--served-model-name",
            MODEL_NAME,
            "--default-timeout",
            "2",
            "--dead-after",
            "5",
        ],
    )
    url = f"http://127.0.0.1:{base + 3}"
    try:
        for role in ("frontend", "prefill", "decode"):
            procs.start(role)
        wait_for(lambda: _get(url + "/health")[0] == 200, 120, "/health to say 200")
        code, reply = _post(
            url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
        )
        assert code == 200 and reply["usage"]["completion_tokens"] == 2
        decode = procs.procs["decode"]
        decode.send_signal(signal.SIGSTOP)  # frozen: silent for 5 s before it counts as dead
        try:
            code, reply = _post(
                url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
            )
            assert code == 504 and reply["error"]["type"] == "timeout", reply
        finally:
            decode.send_signal(signal.SIGCONT)
        decode.kill()
        wait_for(lambda: _get(url + "/health")[0] == 503, 30, "/health to say 503")
        code, reply = _post(
            url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
        )
        assert code == 503 and reply["error"]["type"] == "service_unavailable"
        assert "no live prefill and decode node pair" in reply["error"]["message"]
    finally:
        procs.stop()


@pytest.mark.cluster
def test_metrics_port_without_http(tiny_model, tmp_path):
    """--metrics-port serves /metrics and /health alone; the OpenAI routes stay off."""
    base = free_base_port(4)
    procs = Processes(tiny_model, base, tmp_path, frontend=["--metrics-port", str(base + 3)])
    url = f"http://127.0.0.1:{base + 3}"
    try:
        procs.start("frontend")
        wait_for(lambda: _get(url + "/health")[0] == 503, 120, "/health to say 503 with no nodes")
        status, text = _get(url + "/metrics")
        names = {f.name for f in text_string_to_metric_families(text.decode())}
        assert status == 200 and {"pdserve_requests_running", "pdserve_requests_finished"} <= names
        assert _get(url + "/v1/models")[0] == 404
    finally:
        procs.stop()
