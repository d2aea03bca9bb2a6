"""The continuous-batching engine: scheduler, model runner, sampler. No Ray imports.

Names resolve lazily, so importing a torch-free module of this package (config, errors,
sampling_params) from the API layer does not pull in torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineConfig": "server.engine.config", "LLMEngine": "server.engine.engine",
    "InvalidRequestError": "server.engine.errors", "QueueFullError": "server.engine.errors",
    "SamplingParams": "server.engine.sampling_params", "RequestOutput": "server.wire",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
