"""Decoder-only Transformers built from one MHA/GQA/MQA attention class.

Names resolve lazily, so importing a torch-free module of this package (native.cpu_features) first
lets the CPU's ISA cap reach torch before torch starts.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CausalSelfAttention": "models.attention", "DenseAttention": "models.attention",
    "reference_attention": "models.attention", "ModelConfig": "models.config", "RopeConfig": "models.config",
    "load_model": "models.loader", "load_tokenizer": "models.tokenizer", "resolve_model": "models.registry",
    "DecoderLM": "models.transformer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
