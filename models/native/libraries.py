"""The one loader of attnserve's C++ libraries: `load(name)` builds (first use) and loads this
machine's library into torch.ops; `available(name)` says whether that worked. Each is once per
process and name; a library that cannot be built is one warning, and the caller's slower path.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from models.native.cpu_features import machine_isa
from models.native.toolchain import build

logger = logging.getLogger(__name__)
# Each library's name in a warning, and what runs where it cannot be built
_FALLBACKS = {
    "paged_attention": ("paged-attention", "attention falls back to gather + SDPA, which is slower"),
    "panel_linear": ("panel-linear", "linears take oneDNN's or torch's kernels"),
    "quant_linear": ("quantized-linear", "quantized weights are dequantized at load"),
    "q8_linear": ("8-bit-activation linear", "quantized linears keep exact activations"),
    "decoder": ("decoder", "the compiled step serves"),
    "shm_comm": ("shared-memory collectives", "tensor-parallel ranks use the process group's"),
    "logit_scores": ("prompt-logprob", "prompt logprobs take torch's log_softmax, comparison and topk; greedy tokens its max(dim)"),
    "lora": ("LoRA", "LoRA deltas take torch's index_select + mm"),
}


@functools.cache
def load(name: str) -> str:
    """Load this machine's library for `name`; returns the level it was built for. Raises where it
    cannot be built (no compiler)."""

    isa = machine_isa()
    torch.ops.load_library(str(build(name, isa)))
    return isa


@functools.cache
def available(name: str) -> bool:
    try:
        load(name)
    except Exception as e:  # noqa: BLE001 - any build failure means: the slower path
        label, fallback = _FALLBACKS[name]
        logger.warning("attnserve: the C++ %s kernel is unavailable (%s); %s", label, str(e).splitlines()[0], fallback)
        return False
    return True


def native_enabled() -> bool:
    """ATTNSERVE_NATIVE=0 turns our attention and panel kernels off (the gather + SDPA and oneDNN paths)."""
    return os.environ.get("ATTNSERVE_NATIVE", "1") != "0"
