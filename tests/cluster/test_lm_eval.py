"""An independent client, side by side: lm-evaluation-harness scores a small local task
(written here, nothing downloaded) through pdserve's OpenAI API (its local-completions
model: echo + logprobs for loglikelihoods, greedy generation with stop strings) and
through transformers' own model (its hf model) on the same checkpoint. The scores and
every answer are the same. On an 8-bit KV cache (int8, fp8), every choice's
loglikelihood equals transformers' whose cache applies the same loss, and its distance
from the unquantized model's is bounded and printed."""

from __future__ import annotations

import json
import random

import pytest

from tests.cluster_util import Cluster
from tests.kv_quant_ref import QuantizedReferenceCache

pytestmark = pytest.mark.cluster  # every test here starts processes

MODEL = "tiny"
WORDS = "the water is hot and the day is long so we go to the sea where it is cold".split()


def _greedy_choice(model_dir):
    """text -> the text of the model's most likely next token, or None where that text
    would not stay one token after it (lm-eval splits context and choice by tokens)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def choose(text: str) -> str | None:
        ids = tok.encode(text)
        with torch.no_grad():
            best = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        choice = tok.decode([best])
        return choice if tok.encode(text + choice) == ids + [best] else None

    return choose


def _write_tasks(root, model_dir, seed: int = 0) -> None:
    """A multiple-choice task (loglikelihood of each choice after a question; where it
    can be, one choice is the model's greedy next token, so is_greedy is seen both ways)
    and a generation task (greedy, until a newline), as lm-eval YAML over local JSON lines."""
    rng, greedy = random.Random(seed), _greedy_choice(model_dir)
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    with mc.open("w") as f:
        for _ in range(24):
            question = " ".join(rng.choices(WORDS, k=rng.randint(3, 12))) + ":"
            choices = [" " + " ".join(rng.choices(WORDS, k=rng.randint(1, 4))) for _ in range(3)]
            choices.insert(rng.randrange(4), greedy(question) or " " + rng.choice(WORDS))
            f.write(
                json.dumps({"question": question, "choices": choices, "answer": rng.randrange(4)})
                + "\n"
            )
    with gen.open("w") as f:
        for _ in range(12):
            f.write(
                json.dumps(
                    {
                        "question": " ".join(rng.choices(WORDS, k=rng.randint(3, 12))),
                        "answer": rng.choice(WORDS),
                    }
                )
                + "\n"
            )
    common = 'dataset_path: json\ntest_split: test\ndoc_to_text: "{{question}}"\n'
    (root / "pd_mc.yaml").write_text(
        f"task: pdserve_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        'output_type: multiple_choice\ntarget_delimiter: ""\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "pd_gen.yaml").write_text(
        f"task: pdserve_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        'output_type: generate_until\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )


def _evaluate(
    model: str, model_args: str, tasks_dir, batch_size: int = 1, tasks=("pdserve_mc", "pdserve_gen")
) -> dict:
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(tasks_dir)),
        batch_size=batch_size,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )


def _evaluate_ours(cluster, model_dir, tasks_dir, **kw) -> dict:
    """Through pdserve's OpenAI API, batches of prompts in one call, as users run it."""
    return _evaluate(
        "local-completions",
        f"model={MODEL},base_url={cluster.http}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={model_dir},num_concurrent=1,max_retries=1",
        tasks_dir,
        batch_size=4,
        **kw,
    )


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    c = Cluster(
        tiny_model, tmp_path_factory.mktemp("lm_eval") / "c.log", "--served-model-name", MODEL
    )
    yield c
    c.stop()


def test_lm_eval_scores_the_same_on_pdserve_as_on_transformers(
    cluster, tiny_model, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_tasks(tmp_path, tiny_model)
    ours = _evaluate_ours(cluster, tiny_model, tmp_path)
    theirs = _evaluate("hf", f"pretrained={tiny_model},dtype=float32,device=cpu", tmp_path)
    for task, metrics in (
        ("pdserve_mc", ("acc,none", "acc_norm,none")),
        ("pdserve_gen", ("exact_match,none",)),
    ):
        for m in metrics:
            assert ours["results"][task][m] == theirs["results"][task][m], (task, m)
    # Answer by answer: each choice's loglikelihood (fp32: 1e-4) and whether it is greedy;
    # each generation's text.
    mine = sorted(ours["samples"]["pdserve_mc"], key=lambda s: s["doc_id"])
    ref = sorted(theirs["samples"]["pdserve_mc"], key=lambda s: s["doc_id"])
    assert len(mine) == len(ref) == 24
    num_greedy = 0
    for a, b in zip(mine, ref):
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]]
        ):
            assert float(lp_a) == pytest.approx(float(lp_b), abs=1e-4) and bool(greedy_a) == bool(
                greedy_b
            )
            num_greedy += bool(greedy_a)
    assert num_greedy > 0  # is_greedy is really compared, not always false
    gen_a = sorted(ours["samples"]["pdserve_gen"], key=lambda s: s["doc_id"])
    gen_b = sorted(theirs["samples"]["pdserve_gen"], key=lambda s: s["doc_id"])
    # NOTE: transformers shows the bytes of a character cut by max_gen_toks as U+FFFD;
    # pdserve drops them (as vLLM does): the texts are the same up to those.
    assert [s["resps"][0][0] for s in gen_a] == [s["resps"][0][0].rstrip("\ufffd") for s in gen_b]
    assert any(s["resps"][0][0] for s in gen_a)  # something was generated


def _loglikelihoods(model_dir, pairs, make_cache=None) -> list[float]:
    """transformers' loglikelihood of each (context, continuation), split into tokens as
    lm-eval splits them (the whole encoded, the context's tokens first); make_cache(): a
    cache the one forward pass stores its keys and values in, and attends to."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for context, continuation in pairs:
        whole, n = tok.encode(context + continuation), len(tok.encode(context))
        with torch.no_grad():
            cache = make_cache() if make_cache else None
            logits = model(torch.tensor([whole]), past_key_values=cache, use_cache=bool(cache))
        logp = torch.log_softmax(logits.logits[0].float(), dim=-1)
        out.append(sum(logp[n - 1 + i, t].item() for i, t in enumerate(whole[n:])))
    return out


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_lm_eval_on_an_8bit_cache_scores_as_its_reference_near_the_full_model(
    tiny_model, tmp_path, monkeypatch, kv_format
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_tasks(tmp_path, tiny_model)
    cluster = Cluster(
        tiny_model,
        tmp_path / "c.log",
        "--served-model-name",
        MODEL,
        "--kv-cache-dtype",
        kv_format,
    )
    try:
        ours = _evaluate_ours(cluster, tiny_model, tmp_path, tasks=("pdserve_mc",))
    finally:
        cluster.stop()
    samples = sorted(ours["samples"]["pdserve_mc"], key=lambda s: s["doc_id"])
    pairs = [tuple(args) for s in samples for args in s["arguments"]]
    got = [float(r[0][0]) for s in samples for r in s["resps"]]
    assert len(got) == len(pairs) == 24 * 4
    ref = _loglikelihoods(tiny_model, pairs, lambda: QuantizedReferenceCache(kv_format))
    assert got == pytest.approx(ref, abs=1e-4)  # the same loss, token for token
    full = _loglikelihoods(tiny_model, pairs)
    diffs = [abs(a - b) for a, b in zip(got, full)]
    print(
        json.dumps(
            {
                "kv_cache_dtype": kv_format,
                "acc": ours["results"]["pdserve_mc"]["acc,none"],
                "max_loglikelihood_diff_vs_full": round(max(diffs), 5),
                "mean_loglikelihood_diff_vs_full": round(sum(diffs) / len(diffs), 5),
            }
        )
    )
    assert 0 < max(diffs) < (0.1 if kv_format == "int8" else 0.5)  # lossy, and close
