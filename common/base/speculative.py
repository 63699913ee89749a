"""What `--speculative-config` asks for: a drafting method and how many tokens it may
propose a step. The spelling is vLLM's (a JSON object: `method`, `num_speculative_tokens`;
prompt lookup's `prompt_lookup_min` / `prompt_lookup_max`; suffix decoding's
`suffix_decoding_max_tree_depth` / `suffix_decoding_max_cached_requests`), `off`, or
`auto` (the default): a decode node's choice for its device (for_decode_node)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("off", "auto", "ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16
AUTO_METHOD, AUTO_TOKENS = "ngram", 4  # what auto turns on, where it does


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "auto"
    num_speculative_tokens: int = 0  # K: the most drafts a sequence is verified with a step
    prompt_lookup_min: int = 1  # n-gram: the shortest suffix that may match
    prompt_lookup_max: int = 3  # n-gram: the longest, tried first
    # suffix: a match and its drafts together are at most this long
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000  # suffix: finished requests kept to match

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: expected one of {METHODS}")
        k = self.num_speculative_tokens
        if self.method in ("off", "auto"):
            # NOTE: auto picks every field itself: one given beside either would be dropped
            given = [
                f.name
                for f in fields(self)
                if f.name != "method" and getattr(self, f.name) != f.default
            ]
            if given:
                raise ValueError(f"{', '.join(given)}: needs a method, not {self.method}")
            return
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], not {k}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 8:
            raise ValueError(
                "prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 8, not "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not 2 <= self.suffix_decoding_max_tree_depth <= 64:
            raise ValueError("suffix_decoding_max_tree_depth must be in [2, 64]")
        if not 0 <= self.suffix_decoding_max_cached_requests <= 100_000:
            raise ValueError("suffix_decoding_max_cached_requests must be in [0, 100000]")

    @property
    def is_on(self) -> bool:
        """Whether a worker given this config drafts (auto: a decode node decides first)."""
        return self.method not in ("off", "auto")

    def for_decode_node(self, is_host: bool, is_row_exact: bool = True) -> SpeculativeConfig:
        """What a decode node on this device runs. auto: prompt lookup of AUTO_TOKENS drafts
        on a CPU (is_host), measured there as fast as plain decoding where drafts never
        match (the draft chooser rests: docs/BENCHMARKS.md), and off elsewhere until it is
        measured there.
        NOTE: prompt lookup, not suffix decoding: its drafts are made on the device, so a
        steady verify step copies nothing from the host either.
        NOTE: off where a row's logits may round apart alone and among others (not
        is_row_exact: Platform.is_row_exact; bf16): a verify step's tokens could differ
        from plain decoding's. Asked for by name, it runs."""
        if self.method != "auto":
            return self
        if not is_host or not is_row_exact:
            return SpeculativeConfig("off")
        return SpeculativeConfig(AUTO_METHOD, AUTO_TOKENS)


def parse_speculative(text: str) -> SpeculativeConfig:
    """`off`, `auto` (or nothing), or a JSON object of SpeculativeConfig's fields (no
    others)."""
    word = text.strip().lower()
    if word in ("off", "none"):
        return SpeculativeConfig("off")
    if word in ("", "auto"):  # NOTE: empty: the default, as the launcher's unset value
        return SpeculativeConfig("auto")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is neither 'off' nor JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError("--speculative-config must be a JSON object")
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--speculative-config: unknown fields {unknown}; known: {sorted(known)}")
    for name, value in values.items():
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if (name == "method") != isinstance(value, str) or (name != "method" and not is_int):
            raise ValueError(f"--speculative-config: {name} = {value!r} has the wrong type")
    return SpeculativeConfig(**values)
