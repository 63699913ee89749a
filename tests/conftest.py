import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """make_model(**shape) -> a tiny checkpoint directory, made once per shape."""
    from launch.make_tiny_model import make_tiny_model
    made: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp("model"), **kwargs)
        return made[key]
    return make


@pytest.fixture(scope="session")
def tiny_model(make_model) -> Path:
    return make_model()


def hf_greedy(model_dir, prompts, max_new_tokens):
    """transformers' own greedy tokens for each prompt, one prompt at a time."""
    import torch
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out
