"""Token-exact greedy decoding and prefill logits against transformers' Qwen3."""

import numpy as np
import pytest
import torch

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from launch.tools.offline import generate
from tests.conftest import hf_greedy

BLOCK = 16
# 1, block-1, block, block+1 and a long one: with 64 new tokens each crosses blocks while decoding.
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 150]
NEW_TOKENS = 64

SHAPES = {
    "gqa2-tied": dict(kv_heads=2, tie_embeddings=True),
    "gqa1-untied": dict(kv_heads=4, tie_embeddings=False),
    "gqa4-untied-sharded": dict(
        heads=8, kv_heads=2, head_dim=8, tie_embeddings=False, max_shard_size="40KB"
    ),
}


def _prompts(seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 400, size=n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_batch_matches_transformers(make_model, shape):
    model_dir = make_model(**SHAPES[shape])
    if "sharded" in shape:
        assert (model_dir / "model.safetensors.index.json").exists()
    prompts = _prompts()
    cfg = WorkerConfig(model=str(model_dir), block_size=BLOCK, max_batch_size=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with DeviceWorker(cfg) as worker:
        results = generate(worker, prompts, [params] * len(prompts))
        assert worker.decode.max_batch == len(prompts)
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    for n, r, ref in zip(LENGTHS, results, expected):
        assert r["token_ids"] == ref, f"prompt of {n} tokens diverged"
        assert r["finish_reason"] == "length"


def test_prefill_logits_within_1e4(make_model):
    from transformers import Qwen3ForCausalLM

    model_dir = make_model(**SHAPES["gqa2-tied"])
    prompts = _prompts(seed=1)
    hf = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with DeviceWorker(WorkerConfig(model=str(model_dir), block_size=BLOCK)) as worker:
        alloc = BlockAllocator(worker.num_kv_blocks)
        chunks = [
            PrefillChunk(p, 0, alloc.allocate(num_blocks_for(len(p), BLOCK)), SamplingParams())
            for p in prompts
        ]
        _, logits = worker.prefill(chunks, return_logits=True)
    with torch.no_grad():
        for p, ours in zip(prompts, logits):
            ref = hf(torch.tensor([p])).logits[0, -1]
            assert (ours - ref).abs().max().item() < 1e-4


def test_chunked_prefill_equals_whole(tiny_model):
    """A prompt prefilled in chunks gives the same first token and KV as in one pass."""
    prompt = _prompts(seed=2)[-1]
    cfg = WorkerConfig(model=str(tiny_model), block_size=BLOCK)
    with DeviceWorker(cfg) as worker:
        alloc = BlockAllocator(worker.num_kv_blocks)
        whole = alloc.allocate(num_blocks_for(len(prompt), BLOCK))
        (t_whole,), lw = worker.prefill([PrefillChunk(prompt, 0, whole, SamplingParams())], True)
        parts = alloc.allocate(num_blocks_for(len(prompt), BLOCK))
        cut = [0, 40, 41, 100, len(prompt)]
        for a, b in zip(cut, cut[1:]):
            last = b == len(prompt)
            (t_part,), lp = worker.prefill(
                [PrefillChunk(prompt[a:b], a, parts, SamplingParams() if last else None)], True
            )
        assert t_part == t_whole
        assert torch.allclose(lp, lw, atol=1e-5)
        kv_w = worker.export_blocks(whole).flatten(2, 3)[:, :, : len(prompt)]
        kv_p = worker.export_blocks(parts).flatten(2, 3)[:, :, : len(prompt)]
        assert torch.allclose(kv_w, kv_p, atol=1e-5)


def test_unsupported_architecture_is_named(tmp_path):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 8,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "vocab_size": 10,
                "intermediate_size": 8,
            }
        )
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        DeviceWorker(WorkerConfig(model=str(tmp_path))).prepare()
