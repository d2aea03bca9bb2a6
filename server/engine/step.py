"""How a model step runs, chosen once per pool: the native decoder where it covers the model, else
the compiled model, else (no compiler for inductor, or `compile=False`) the eager one."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvcache.storage import PagedKVCache
from models.lora import LoraSlots
from models.native.toolchain import compiler_version
from models.transformer import DecoderLM
from server.engine.compilation import compile_model
from server.engine.native_decoder import NativeDecoder, unsupported

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    forward: Callable[..., torch.Tensor]  # called as DecoderLM is
    kind: str  # native | compiled | eager
    seconds: float  # building it, and for a compiled one compiling (or loading) and warming it up


def choose_step(model: DecoderLM, cache: PagedKVCache, compile: bool, native: bool,
                warm_up: Callable[[Callable[..., torch.Tensor]], None], who: str = "attnserve",
                lora_slots: LoraSlots | None = None) -> Step:
    """`warm_up(forward)` runs a compiled step's first calls (ModelRunner's, or every rank's at once).
    `lora_slots`: the replica's LoRA adapters, which every step's `lora` then refers to."""
    start = time.perf_counter()
    reason = unsupported(model, lora=lora_slots is not None) if compile and native else "not asked for"
    if reason is None:
        return Step(NativeDecoder(model, lora_slots), "native", time.perf_counter() - start)
    if not compile:
        return Step(model, "eager", 0.0)
    try:
        compiler_version()
    except RuntimeError as e:  # NOTE: asked first: without a compiler inductor fails only after tracing (~5 s)
        logger.warning("torch.compile of the %s step needs a C++ compiler (%s); running it eagerly", who, e)
        return Step(model, "eager", 0.0)
    logger.info("%s step: compiled (the native decoder: %s)", who, reason)
    try:
        for t in [*cache.tensors, *(lora_slots.tensors() if lora_slots is not None else ())]:
            # NOTE: a pool's (and the LoRA slots') shape never changes: a compiled step specialises on
            # it instead of checking, on every call, symbolic sizes and strides of each tensor in Python
            torch._dynamo.mark_static(t)
        forward = compile_model(model)
        warm_up(forward)
        return Step(forward, "compiled", time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler for inductor: serve, slower
        logger.warning("torch.compile of the %s step failed (%s: %s); running it eagerly",
                       who, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return Step(model, "eager", 0.0)
