"""Speculative decoding's settings (`--speculative-config`, serve.yaml `engine: speculative_config:`).

Shaped like vLLM's: `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}` or `{"method": "draft_model", "model": "default", "num_speculative_tokens": 4}`.
No torch: the CLI and serve.yaml validate it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from models.native.cpu_path import QUANTIZATIONS

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # the most drafts per sequence and step (k); adaptive k stays at or below it. 3: a verification step of 4
    # rows costs 1.4x a decode step on the quantized CPU kernels (4-row code tiles), 5 rows 1.8x
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched against the sequence so far
    prompt_lookup_min: int = 2  # ngram: the shortest
    model: str | None = None  # draft_model: a directory, .gguf file or name sharing the target's tokenizer
    quantization: str = "auto"  # draft_model: its weights (e.g. the target itself as int4 / its GGUF)
    # no drafts in a step where more requests than this run (None: no such limit)
    disable_by_batch_size: int | None = None
    # the engine switches drafts off at a batch size where its steps with drafts have made fewer tokens
    # per second than its steps without (measured: SpeculationGate); False drafts whenever it can
    auto_disable: bool = True
    # adaptive k: a request drafts the longest i <= k whose chance of acceptance (its moving-average
    # acceptance rate to the power i) is at least this; 0 keeps k fixed
    min_draft_acceptance: float = 0.15

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config: {message}")

        need(self.method in METHODS, f"method must be one of {', '.join(METHODS)}, not {self.method!r}")
        need(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
             "num_speculative_tokens must be an integer in [1, 16]")
        need(isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
             and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        need((self.model is not None) == (self.method == "draft_model"),
             "method draft_model needs a model (and only it takes one)")
        need(self.quantization in QUANTIZATIONS, f"quantization must be one of {', '.join(QUANTIZATIONS)}")
        need(self.disable_by_batch_size is None or (isinstance(self.disable_by_batch_size, int)
                                                    and self.disable_by_batch_size >= 1),
             "disable_by_batch_size must be a positive integer or null")
        need(0 <= self.min_draft_acceptance < 1, "min_draft_acceptance must be in [0, 1)")
        need(isinstance(self.auto_disable, bool), "auto_disable must be true or false")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From JSON text (the CLI), a mapping (serve.yaml) or a config; None or empty: no speculation."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a method ({', '.join(METHODS)})")
        return cls(**value)

    def num_drafts(self, acceptance: float) -> int:
        """Adaptive k: drafts worth verifying for a request whose acceptance rate averages `acceptance`."""
        k = self.num_speculative_tokens
        if not self.min_draft_acceptance:
            return k
        i = 1
        while i < k and acceptance ** (i + 1) >= self.min_draft_acceptance:
            i += 1
        return i
