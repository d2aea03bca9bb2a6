"""Embeddings from a decoder's final hidden states: which positions a model pools, and whether it
normalises, read from its sentence-transformers config (`modules.json` + `1_Pooling/config.json`, a
`Normalize` module) or given by flags; and one request's pooling as its prefill's chunks compute it.

No torch import (the wire carries `Pooling`): `PooledPrompt` only calls the methods of the tensors
the model runner hands it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from server.engine.sampling_params import SamplingParams

BOTH = "generate,embed"  # a model that answers both kinds, in the same engine steps
TASKS = ("auto", "generate", "embed", BOTH)  # auto: embed for a sentence-transformers checkpoint, else generate
METHODS = ("last", "mean", "cls")  # the last token's hidden state, the mean over the prompt, the first token's
POOLING_CHOICES = ("auto", *METHODS)  # auto: the checkpoint's, else last (decoder embedding models pool the last)
NORM_EPS = 1e-12  # torch.nn.functional.normalize's: sentence-transformers' Normalize module divides by max(|v|, eps)
EMBED_PARAMS = SamplingParams(max_tokens=1)  # an embedding request samples nothing: these only fill its slot
# sentence-transformers' Pooling config flags -> our methods (one must be set; max and the weighted forms are not served)
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSERVED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class Pooling:
    """How a model's embeddings are made: `method` over the prompt's final hidden states, then L2-normalised
    or not. An embedding is as wide as the model's hidden size."""

    method: str
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"pooling must be one of {', '.join(METHODS)}, not {self.method!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "normalize": self.normalize}


def truncate(vector: Any, dimensions: int | None) -> np.ndarray:
    """An embedding's first `dimensions` values (Matryoshka), renormalised to unit L2 norm whether or not the
    model normalises: a cut vector's cosines and dot products mean something only at unit norm. (vLLM
    renormalises only a normalising model's.) (C,) -> (dimensions,) float32; None or the full width: as is."""
    v = np.asarray(vector, dtype=np.float32)
    if dimensions is None or dimensions >= len(v):
        return v
    v = v[:dimensions]
    return v / np.float32(max(float(np.linalg.norm(v)), NORM_EPS))


def serves(task: str, kind: str) -> bool:
    """Whether a model served with `task` (ModelInfo.task: generate, embed or both) answers `kind` requests."""
    return kind in task.split(",")


def read_sentence_transformers(model_dir: Path) -> Pooling | None:
    """The pooling a sentence-transformers checkpoint declares, or None where it has no `modules.json`
    with a Pooling module. Raises ValueError for a pooling it declares that is not served (max, weighted)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        return None
    config = json.loads((model_dir / kinds["Pooling"].get("path", "1_Pooling") / "config.json").read_text())
    methods = [ours for flag, ours in _ST_MODES.items() if config.get(flag)]
    unserved = [flag for flag in _ST_UNSERVED if config.get(flag)]
    if len(methods) != 1 or unserved:
        raise ValueError(f"{model_dir}: sentence-transformers pooling {sorted(k for k, v in config.items() if v is True)} "
                         f"is not served; one of {', '.join(_ST_MODES)} is")
    return Pooling(methods[0], normalize="Normalize" in kinds)


def _architecture_embeds(model_dir: Path) -> bool:
    """A base model's checkpoint (architectures `...Model`, no LM head): made for its hidden states."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return False
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    return any(a.endswith("Model") and not a.endswith("LMHeadModel") for a in architectures)


def resolve_pooling(model_dir: Path | None, task: str, method: str = "auto", normalize: bool | None = None) -> Pooling | None:
    """The served model's pooling, None when it serves generation only. `task` auto: embed where the checkpoint
    has a sentence-transformers config (Qwen3-Embedding's config.json says Qwen3ForCausalLM) or is a base
    model's; `method` / `normalize` given override the checkpoint's (else last, normalised)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
    if method not in POOLING_CHOICES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_CHOICES)}, not {method!r}")
    directory = model_dir if model_dir is not None and model_dir.is_dir() else None
    declared = read_sentence_transformers(directory) if directory is not None else None
    if task == "generate" or (task == "auto" and declared is None and
                              (directory is None or not _architecture_embeds(directory))):
        return None
    default = declared or Pooling("last", True)
    return Pooling(default.method if method == "auto" else method,
                   default.normalize if normalize is None else normalize)


class PooledPrompt:
    """One embedding request's pooling so far: its prefill's chunks hand in the hidden-state rows the
    method reads (`rows`), summed in fp32; a chunk from position 0 (the first, or a preempted request's
    recompute) starts over."""

    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling
        self.total: Any = None  # (C,) fp32 sum of the rows read so far
        self.count = 0

    def rows(self, start: int, n: int, num_tokens: int) -> range:
        """Which of a chunk's `n` rows (prompt positions start..start+n-1 of `num_tokens`) the method reads."""
        method = self.pooling.method
        if method == "mean":
            return range(n)
        if method == "cls":
            return range(0, 1 if start == 0 else 0)
        return range(n - 1, n) if start + n == num_tokens else range(0)

    def add(self, rows: Any, start: int) -> None:
        """rows: (k, C) fp32, the chunk's rows `rows` chose; start: the chunk's first position."""
        if start == 0:
            self.total, self.count = None, 0
        if len(rows) == 0:
            return
        part = rows.sum(0)  # (C,)
        self.total = part if self.total is None else self.total + part
        self.count += len(rows)

    def vector(self) -> Any:
        """The embedding, (C,) fp32 numpy: the mean of the rows read (one row for last and cls), normalised
        as the model says."""
        v = self.total / self.count
        if self.pooling.normalize:
            v = v / v.norm().clamp_min(NORM_EPS)
        return v.cpu().numpy()
