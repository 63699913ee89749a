"""Load a Hugging Face Qwen3 checkpoint (single or sharded safetensors) into Qwen3Weights."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors import safe_open

from common.base.config import WorkerConfig
from common.base.log import get_logger
from common.base.model_spec import ModelSpec, load_spec, preset_spec
from common.engine import qwen3
from common.engine.qwen3 import LayerWeights, Qwen3Weights

log = get_logger("loader")


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def load_model(cfg: WorkerConfig, platform, dtype) -> tuple[ModelSpec, Qwen3Weights]:
    """The model's spec and weights as its platform computes with them: cfg.model's checkpoint
    (else random at cfg.shape), the matrices laid out for the device's linear and held where
    the platform keeps them; on a host, the vectors in fp32 (the sums stay fp32)."""
    spec = load_spec(cfg.model) if cfg.model else preset_spec(cfg.shape)
    if cfg.model:
        weights = load_weights(cfg.model, spec, platform.device, dtype)
    else:
        weights = qwen3.random_weights(spec, platform.device, dtype, cfg.seed)
    if platform.is_host:  # NOTE: bf16 weights and KV halve what a step streams
        qwen3.set_activation_dtype(weights, torch.float32)
    qwen3.pack_matmul_weights(weights)
    qwen3.hold_matrices(weights, platform.hold)
    platform.release_memory()  # NOTE: on a host, what hold copied from
    return spec, weights


def load_weights(model_dir: str | Path, spec: ModelSpec, device, dtype) -> Qwen3Weights:
    """Every shard is read in turn, and each says its size and time as it is read (a large
    model takes minutes: the log shows it moving)."""
    model_dir = Path(model_dir)
    raw: dict[str, torch.Tensor] = {}
    files = _checkpoint_files(model_dir)
    started = time.perf_counter()
    for i, path in enumerate(files):
        t0 = time.perf_counter()
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                raw[name.removeprefix("model.")] = f.get_tensor(name)
        size = path.stat().st_size
        log.info(
            "read weights %d/%d (%s): %s in %.1fs",
            i + 1,
            len(files),
            path.name,
            f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB",
            time.perf_counter() - t0,
        )

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"checkpoint {model_dir} has no tensor {name!r}")
        return raw.pop(name).to(device=device, dtype=dtype)

    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        qkv = torch.cat(
            [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]
        )
        bias = None
        if spec.has_attention_bias:
            bias = torch.cat(
                [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")]
            )
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=bias,
                q_norm=take(a + "q_norm.weight"),
                k_norm=take(a + "k_norm.weight"),
                o_proj=take(a + "o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat(
                    [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                ),
                down=take(p + "mlp.down_proj.weight"),
            )
        )
    embed = take("embed_tokens.weight")
    if "lm_head.weight" in raw and not spec.is_tied_embeddings:
        lm_head = take("lm_head.weight")
    else:
        raw.pop("lm_head.weight", None)
        lm_head = embed
    weights = Qwen3Weights(embed=embed, layers=layers, norm=take("norm.weight"), lm_head=lm_head)
    log.info(
        "weights on %s in %s: %.1fs in all",
        device,
        str(dtype).removeprefix("torch."),
        time.perf_counter() - started,
    )
    return weights
