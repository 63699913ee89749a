"""A model directory as every process checks it before it loads anything: without torch,
so a launcher can refuse a bad --model at once."""

from __future__ import annotations

import re
from pathlib import Path


def check_model_dir(path: str, needs_tokenizer: bool = False) -> None:
    """A local Hugging Face model directory, or a ValueError a user can act on."""
    d = Path(path)
    if not d.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith((".", "/")):
            raise ValueError(
                f"'{path}' looks like a model id, and there is no such directory "
                f"here: pdserve loads models from local directories and downloads "
                f"nothing; give --model the directory holding config.json and the "
                f"weights"
            )
        raise ValueError(
            f"no model directory at {path}: give --model a directory holding "
            f"config.json and the weights"
        )
    if not (d / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: give --model a Hugging Face model directory")
    if needs_tokenizer and not any(
        (d / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer.model")
    ):
        raise ValueError(
            f"{path} has no tokenizer files (tokenizer.json, or vocab.json and "
            f"merges.txt): the frontend tokenizes prompts with the model's tokenizer; "
            f"copy them into the directory"
        )
