"""The 8-bit KV cache: storage dtypes, per-layer scales, and the calibration that picks them.

One power-of-two scale per layer for K and one for V ("per tensor"). The 8-bit formats are
floats, so a scale only places the values in their range: a scale per block and head measured
no better in perplexity (docs/attention.md). A power of two also makes scaling exact both ways,
so 8-bit values widen to bf16 / fp32 with no rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from models.attention import DenseAttention
from models.transformer import DecoderLM

KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
HEADROOM = 4.0  # the calibrated |max| lands at 1/4 of the format's largest value: room for outliers
NUM_CALIBRATION_TOKENS = 512
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the quarterly report. Revenue rose 12% to $4.2 million, "
    "while costs fell slightly; the board asked why shipping delays had doubled since March. "
    "\"We moved two warehouses,\" the director explained, \"and the new routes took longer to settle.\" "
    "Meanwhile, in the lab, the team measured the boiling point of water at 3,000 metres: 90.0 °C. "
    "def mean(xs):\n    return sum(xs) / len(xs)\n\nprint(mean([1, 2, 3]))\n"
    "Q: What is the capital of France? A: Paris. Q: How many legs does a spider have? A: Eight. "
    "She opened the old letter slowly, read the first line twice, and smiled for the first time in weeks. "
)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """'auto' (the model's dtype), 'fp8_e4m3' or 'fp8_e5m2' -> the pool's storage dtype."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    return KV_CACHE_DTYPES[name]


def is_8bit(dtype: torch.dtype) -> bool:
    return dtype in KV_CACHE_DTYPES.values()


def power_of_two_scale(amax: float, dtype: torch.dtype) -> float:
    """The smallest power of two that maps amax x HEADROOM to at most dtype's largest value."""
    return 2.0 ** math.ceil(math.log2(max(amax, 1e-30) * HEADROOM / torch.finfo(dtype).max))


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in an 8-bit float, rounded to nearest even, saturating at the largest value.

    NOTE: magnitudes below the smallest normal are flushed to +0, as the C++ kernel does: a pool
    then never holds a subnormal, and widening a code is a shift and an exponent rebias. (They
    are below 2^-6 of the scale for e4m3: the calibrated |max| sits at 112 x the scale.)"""
    info = torch.finfo(dtype)
    y = (x.float() * (1.0 / scale)).clamp(-info.max, info.max)
    return torch.where(y.abs() < info.tiny, 0.0, y).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) * scale


@dataclass(frozen=True)
class KVScales:
    """Per layer: what K and V were divided by before they were stored."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)


class _AbsMax:
    """An AttentionFn that records each layer's largest |K| and |V| on the way through."""

    def __init__(self, num_tokens: int) -> None:
        self.inner = DenseAttention((num_tokens,))
        self.amax: dict[int, tuple[float, float]] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 variant=None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.amax[layer_idx] = (k.abs().max().item(), v.abs().max().item())
        return self.inner(layer_idx, q, k, v, variant, sinks)


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """The calibration text's tokens; a fixed pseudo-random sequence for a model with no tokenizer."""
    if tokenizer is not None:
        ids = tokenizer(CALIBRATION_TEXT)["input_ids"]
        return list((ids * -(-NUM_CALIBRATION_TOKENS // len(ids)))[:NUM_CALIBRATION_TOKENS])
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (NUM_CALIBRATION_TOKENS,), generator=g).tolist()


def scales_for(model: DecoderLM, dtype: torch.dtype, tokenizer) -> KVScales | None:
    """The scales a pool of `dtype` needs for `model`: None unless it is 8-bit."""
    if not is_8bit(dtype):
        return None
    return calibrate(model, calibration_ids(tokenizer, model.config.vocab_size), dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """'fp8_e4m3' / 'fp8_e5m2' for an 8-bit pool, else 'bfloat16' / 'float32'."""
    return next((name for name, d in KV_CACHE_DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


@torch.inference_mode()
def calibrate(model: DecoderLM, token_ids: Sequence[int], dtype: torch.dtype) -> KVScales:
    """Scales for an 8-bit pool of `dtype`, from one dense forward pass over `token_ids`.

    NOTE: fixed at load, never per request: a greedy output depends on the scales, so they must
    not depend on which request came first."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    n = min(ids.numel(), model.config.max_position_embeddings)
    probe = _AbsMax(n)
    model(ids[:n], torch.arange(n, device=model.device), probe)
    layers = range(model.config.num_layers)
    return KVScales(tuple(power_of_two_scale(probe.amax[i][0], dtype) for i in layers),
                    tuple(power_of_two_scale(probe.amax[i][1], dtype) for i in layers))
