"""The shape of a Qwen3 dense model, read from a Hugging Face config or a preset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    is_tied_embeddings: bool
    has_attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + 2 * self.head_dim
        embed = self.vocab_size * self.hidden_size * (1 if self.is_tied_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + self.hidden_size

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_size


def spec_from_hf_config(config) -> ModelSpec:
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if model_type != "qwen3" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
        raise ValueError(
            f"unsupported architecture {archs or model_type!r}: pdserve serves "
            f"Qwen3 dense models ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if getattr(config, "use_sliding_window", False):
        raise ValueError("Qwen3 with use_sliding_window=True is not supported")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}: only 'default' is implemented")
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    num_heads = config.num_attention_heads
    return ModelSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=config.num_key_value_heads or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(rope_theta),
        max_position_embeddings=config.max_position_embeddings,
        is_tied_embeddings=bool(config.tie_word_embeddings),
        has_attention_bias=bool(getattr(config, "attention_bias", False)),
        eos_token_ids=eos_ids,
    )


def load_spec(model_dir: str | Path) -> ModelSpec:
    from transformers import AutoConfig

    return spec_from_hf_config(AutoConfig.from_pretrained(str(model_dir)))


def _preset(layers, hidden, inter, heads, kv_heads, tied, max_pos=40960) -> ModelSpec:
    return ModelSpec(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=max_pos,
        is_tied_embeddings=tied,
        eos_token_ids=(151645, 151643),
    )


# The published Qwen3 dense shapes, for benchmarks that build random weights.
PRESETS: dict[str, ModelSpec] = {
    "qwen3-0.6b": _preset(28, 1024, 3072, 16, 8, True),
    "qwen3-1.7b": _preset(28, 2048, 6144, 16, 8, True),
    "qwen3-4b": _preset(36, 2560, 9728, 32, 8, True),
    "qwen3-8b": _preset(36, 4096, 12288, 32, 8, False),
    "qwen3-14b": _preset(40, 5120, 17408, 40, 8, False),
    "qwen3-32b": _preset(64, 5120, 25600, 64, 8, False),
}


def preset_spec(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]
