"""One causal self-attention class for MHA, GQA and MQA.

The layer owns the projections and RoPE; the attention itself is delegated to an
`AttentionFn` chosen per step (dense here, paged in `kvcache`), so the model never
holds cache state of its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.rope import apply_rope


class AttentionFn(Protocol):
    """Attention for one layer over packed tokens: q (T, H, D), k/v (T, Hkv, D) -> (T, H, D)."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None) -> torch.Tensor:
    """Additive mask M: 0 where query i may see key j, -inf above the (bottom-right aligned) diagonal."""
    offset = num_keys - num_queries  # earlier (cached) keys every query may see
    return torch.full((num_queries, num_keys), float("-inf"), device=device).triu(diagonal=offset + 1)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(d_k) + M) V, written out; returns (output, weights).

    q (..., H, Sq, D), k/v (..., Hkv, Sk, D). K/V heads are repeated explicitly: this is the
    oracle, not the fast path. Also accepts plain (Sq, D) matrices.
    """
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)  # (..., H, Sk, D)
        v = v.repeat_interleave(group, dim=-3)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., H, Sq, Sk)
    if causal:
        scores = scores + causal_mask(q.shape[-2], k.shape[-2], q.device).to(scores.dtype)
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Fast path: SDPA (flash kernel on CPU and CUDA); GQA without materialising repeated K/V."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[-3] != q.shape[-3])


@dataclass(frozen=True)
class DenseAttention:
    """Attention with no KV cache over packed sequences: each sequence sees only its own past."""

    seq_lens: tuple[int, ...]
    impl: Literal["sdpa", "reference"] = "sdpa"

    def __post_init__(self) -> None:
        if not self.seq_lens or min(self.seq_lens) <= 0:
            raise ValueError("seq_lens must be non-empty and positive")
        if self.impl not in ("sdpa", "reference"):
            raise ValueError(f"unknown attention impl {self.impl!r}")

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if len(set(self.seq_lens)) == 1:  # equal lengths: one batched call
            return self._attend(q, k, v, len(self.seq_lens))
        outs, start = [], 0
        for n in self.seq_lens:
            outs.append(self._attend(q[start:start + n], k[start:start + n], v[start:start + n], 1))
            start += n
        return torch.cat(outs)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int) -> torch.Tensor:
        t, h, d = q.shape
        qb = q.view(batch, t // batch, h, d).transpose(1, 2)  # (B, H, S, D)
        kb = k.view(batch, t // batch, k.shape[1], d).transpose(1, 2)  # (B, Hkv, S, D)
        vb = v.view(batch, t // batch, v.shape[1], d).transpose(1, 2)  # (B, Hkv, S, D)
        if self.impl == "sdpa":
            out = sdpa_causal(qb, kb, vb)
        else:
            out, _ = reference_attention(qb, kb, vb)
        return out.transpose(1, 2).reshape(t, h, d)  # (T, H, D)


class CausalSelfAttention(nn.Module):
    """Q/K/V projections (fused into one matmul), RoPE, attention, output projection.

    num_kv_heads == num_heads is MHA, 1 is MQA, anything in between is GQA.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        attention: AttentionFn,
    ) -> torch.Tensor:
        t, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, self.head_dim)  # (T, H + 2 Hkv, D)
        qk, v = qkv[:, : h + hkv], qkv[:, h + hkv:]  # (T, H + Hkv, D), (T, Hkv, D)
        if rope is not None:
            qk = apply_rope(qk, *rope)  # q and k rotated in one pass
        q, k = qk[:, :h], qk[:, h:]  # (T, H, D), (T, Hkv, D)
        out = attention(self.layer_idx, q, k, v)  # (T, H, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
