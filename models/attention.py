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
from models.layers import make_norm
from models.lora import LoraStep
from models.rope import apply_rope


@dataclass(frozen=True)
class AttentionVariant:
    """How one layer's attention departs from plain causal softmax(Q K^T / sqrt(d_k)) V.

    Config, not subclasses: every AttentionFn (dense, paged, the oracle) takes the same fields.
    Learned sinks are weights, so the layer passes them beside this (`sinks`, one logit per head).
    """

    # softmax scale: 1/sqrt(head_dim), or the model's own (Gemma's query_pre_attn_scalar^-1/2, Granite's multiplier)
    scale: float
    window: int | None = None  # sliding window: query at position i sees keys j with i - window < j <= i
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2)

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError("attention scale must be positive")
        if self.window is not None and self.window <= 0:
            raise ValueError("a sliding window must hold at least one token")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError("a logit soft-cap must be positive")

    @classmethod
    def plain(cls, head_dim: int) -> AttentionVariant:
        return cls(1.0 / math.sqrt(head_dim))


class AttentionFn(Protocol):
    """Attention for one layer over packed tokens: q (T, H, D), k/v (T, Hkv, D) -> (T, H, D).
    `variant` None is plain causal attention with scale 1/sqrt(D); `sinks` (H,) fp32 or None."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 variant: AttentionVariant | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor: ...


def causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None,
                window: int | None = None) -> torch.Tensor:
    """Additive mask M: 0 where query i may see key j, -inf above the (bottom-right aligned) diagonal
    and, with a window, at keys `window` or more positions behind the query."""
    offset = num_keys - num_queries  # earlier (cached) keys every query may see
    mask = torch.full((num_queries, num_keys), float("-inf"), device=device).triu(diagonal=offset + 1)
    if window is not None:
        mask = mask + torch.full_like(mask, float("-inf")).tril(diagonal=offset - window)
    return mask


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    variant: AttentionVariant | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(cap(s Q K^T) + M) V, written out; returns (output, weights).

    q (..., H, Sq, D), k/v (..., Hkv, Sk, D). K/V heads are repeated explicitly: this is the
    oracle, not the fast path. Also accepts plain (Sq, D) matrices. With `sinks` (H,), each row's
    softmax has one more logit per head that attends to nothing: the weights returned leave it
    out, so a row sums to 1 minus the sink's share.
    """
    variant = variant or AttentionVariant.plain(q.shape[-1])
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)  # (..., H, Sk, D)
        v = v.repeat_interleave(group, dim=-3)
    scores = q @ k.transpose(-2, -1) * variant.scale  # (..., H, Sq, Sk)
    if variant.softcap is not None:
        scores = variant.softcap * torch.tanh(scores / variant.softcap)
    if causal:
        scores = scores + causal_mask(q.shape[-2], k.shape[-2], q.device, variant.window).to(scores.dtype)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)  # (..., H, Sq, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # (..., H, Sq, Sk)
    return weights @ v, weights


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: AttentionVariant | None = None) -> torch.Tensor:
    """Fast path: SDPA (flash kernel on CPU and CUDA); GQA without materialising repeated K/V.
    A window becomes a boolean mask; soft-caps and sinks are not SDPA's (`DenseAttention` sends
    those to the reference)."""
    variant = variant or AttentionVariant.plain(q.shape[-1])
    gqa = k.shape[-3] != q.shape[-3]
    if variant.window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=variant.scale, enable_gqa=gqa)
    mask = causal_mask(q.shape[-2], k.shape[-2], q.device, variant.window) == 0  # (Sq, Sk) True = may see
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=variant.scale, enable_gqa=gqa)


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

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 variant: AttentionVariant | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if len(set(self.seq_lens)) == 1:  # equal lengths: one batched call
            return self._attend(q, k, v, len(self.seq_lens), variant, sinks)
        outs, start = [], 0
        for n in self.seq_lens:
            outs.append(self._attend(q[start:start + n], k[start:start + n], v[start:start + n], 1, variant, sinks))
            start += n
        return torch.cat(outs)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int,
                variant: AttentionVariant | None, sinks: torch.Tensor | None) -> torch.Tensor:
        t, h, d = q.shape
        qb = q.view(batch, t // batch, h, d).transpose(1, 2)  # (B, H, S, D)
        kb = k.view(batch, t // batch, k.shape[1], d).transpose(1, 2)  # (B, Hkv, S, D)
        vb = v.view(batch, t // batch, v.shape[1], d).transpose(1, 2)  # (B, Hkv, S, D)
        if self.impl == "sdpa" and sinks is None and (variant is None or variant.softcap is None):
            out = sdpa_causal(qb, kb, vb, variant)
        else:
            out, _ = reference_attention(qb, kb, vb, variant=variant, sinks=sinks)
        return out.transpose(1, 2).reshape(t, h, d)  # (T, H, D)


class CausalSelfAttention(nn.Module):
    """Q/K/V projections (fused into one matmul), QK-norm, RoPE, attention, output projection.

    num_kv_heads == num_heads is MHA, 1 is MQA, anything in between is GQA. The variants
    (window, soft-cap, query pre-scale, sinks) are this layer's `AttentionVariant`, handed to
    whichever AttentionFn runs the step.
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
        self.variant = AttentionVariant(cfg.attention_scale, cfg.window(layer_idx), cfg.attn_softcap)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            self.q_norm = make_norm(cfg, cfg.head_dim if per_head else q_size)
            self.k_norm = make_norm(cfg, cfg.head_dim if per_head else kv_size)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attn_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        attention: AttentionFn,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """`lora`: each adapter row's delta, added to q/k/v before QK-norm and RoPE (where PEFT adds it)."""
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) D)
        if lora is not None:
            qkv = lora.apply(self.layer_idx, "qkv", x, qkv)
        if self.qk_norm == "all":  # over every head at once, before the split into heads (OLMo 2)
            q, k, v = qkv.split((h * d, hkv * d, hkv * d), dim=-1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-1).view(t, h + hkv, d)  # (T, H + Hkv, D)
            v = v.reshape(t, hkv, d)  # (T, Hkv, D)
        else:
            qkv = qkv.view(t, h + 2 * hkv, d)  # (T, H + 2 Hkv, D)
            qk, v = qkv[:, : h + hkv], qkv[:, h + hkv:]  # (T, H + Hkv, D), (T, Hkv, D)
            if self.qk_norm == "head":  # per head (Qwen3, Gemma 3)
                qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        if rope is not None:
            qk = apply_rope(qk, *rope)  # q and k rotated in one pass
        q, k = qk[:, :h], qk[:, h:]  # (T, H, D), (T, Hkv, D)
        sinks = None if self.sinks is None else self.sinks.float()
        out = attention(self.layer_idx, q, k, v, self.variant, sinks).reshape(t, h * d)  # (T, H D)
        if lora is None:
            return self.o_proj(out)
        return lora.apply(self.layer_idx, "o", out, self.o_proj(out))
