import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from launch.reference import clear_prompts, hf_greedy, hf_greedy_gaps  # noqa: E402,F401 (the tests import them here)


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
