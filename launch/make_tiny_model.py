"""Write a random-weight Qwen3 checkpoint in Hugging Face format, with a byte-level
BPE tokenizer trained on the spot (nothing is downloaded).

    python -m launch.make_tiny_model OUT_DIR [--layers 2 --hidden-size 64 ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.runtime.process import HelpFormat

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's tags, as Qwen3 has them: added, not special, so they stay in decoded text.
TAG_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
]
# Qwen3's chat format, tools and thinking included (a shorter template than Qwen3's own).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{% if not loop.first %}<|im_start|>system\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for tc in m['tool_calls'] or [] %}"
    "{% if m['content'] or not loop.first %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ tc[\'function\'][\'name\'] }}", "arguments": '
    "{% if tc['function']['arguments'] is string %}{{ tc['function']['arguments'] }}"
    "{% else %}{{ tc['function']['arguments'] | tojson }}{% endif %}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

_WORDS = (
    "the a of to and in is it that was for on are with as his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them "
    "write would like so these her long make thing see him two has look more day could "
    "go come did number sound no most people my over know water than call first who may "
    "down side been now find any new work part take get place made live where after back "
    "little only round man year came show every good me give our under name very through "
    "just form sentence great think say help low line differ turn cause much mean before "
    "prefill decode token cache block batch stream serve model layer kernel device"
).split()
_EXTRA = [
    "café naïve résumé",
    "日本語のテキスト",
    "中文字符测试",
    "emoji 🙂🚀✨",
    "Ünïcödé ß ø å",
    "def f(x):\n    return x + 1\n",
    "1234567890 3.14159 -42",
    "Hello, world! How are you?",
]


def _corpus(seed: int, num_lines: int = 400) -> list[str]:
    import random

    rng = random.Random(seed)
    lines = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(num_lines)
    ]
    return lines + _EXTRA * 8


def build_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.add_tokens(TAG_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    tie_embeddings: bool = True,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    weight_std: float = 0.3,
) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(min(vocab_size, 400), seed)
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)})"
        )
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_embeddings,
        rms_norm_eps=1e-6,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            # Norm weights away from 1 so a kernel that ignores them is caught; layer
            # weights large enough that greedy output varies instead of echoing the input.
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * weight_std)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    tokenizer.save_pretrained(out)
    gen_cfg = out / "generation_config.json"
    if gen_cfg.exists():  # greedy by default: no sampling settings baked in
        cfg = json.loads(gen_cfg.read_text())
        cfg.pop("do_sample", None)
        gen_cfg.write_text(json.dumps(cfg, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="pdserve make-tiny-model", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument("out_dir", help="the model directory to write (made if missing)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--hidden-size", type=int, default=64, help="the model's width")
    p.add_argument("--intermediate-size", type=int, default=128, help="the MLP's width")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=16, help="each head's width")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=512,
        help="the tokenizer trained here has this many tokens",
    )
    p.add_argument(
        "--max-position-embeddings", type=int, default=1024, help="the model's longest sequence"
    )
    p.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lm_head shares the embedding's weights",
    )
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the dtype the weights are saved in",
    )
    p.add_argument("--max-shard-size", default=None, help="e.g. 100KB: write a sharded checkpoint")
    p.add_argument(
        "--weight-std",
        type=float,
        default=0.3,
        help="std of the layer weights (large enough that greedy output varies)",
    )
    a = p.parse_args(argv)
    out = make_tiny_model(
        a.out_dir,
        layers=a.layers,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        vocab_size=a.vocab_size,
        max_position_embeddings=a.max_position_embeddings,
        tie_embeddings=a.tie_embeddings,
        seed=a.seed,
        dtype=a.dtype,
        max_shard_size=a.max_shard_size,
        weight_std=a.weight_std,
    )
    print(out)


if __name__ == "__main__":
    main()
