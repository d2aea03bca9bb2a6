"""Rotary position embeddings as pure functions (HF `rotate_half` layout)."""
from __future__ import annotations

import math

import torch

from models.config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in fp32, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables for explicit positions: (T,) -> cos (T, 1, D) and sign-folded sin (T, 1, D) in `dtype`.

    sin's first half is negated so that rotate_half(x) * sin == swap_halves(x) * signed_sin.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)  # (T, D)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # (T, D)
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate (T, heads, D) by (T, 1, D) tables: x * cos + rotate_half(x) * sin (HF layout)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (T, heads, D)
    return x * cos + swapped * signed_sin
