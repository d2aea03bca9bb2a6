"""Norms and MLPs shared by every architecture."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in fp32, cast back, then scale (Llama). The same rounding as
    each model's own: `kind` rmsnorm_fp32 scales before the cast (OLMo 2), gemma_rmsnorm scales
    by (1 + w) before the cast (Gemma)."""

    def __init__(self, dim: int, eps: float, kind: str = "rmsnorm") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if kind == "gemma_rmsnorm" else torch.ones(dim))
        self.eps = eps
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.kind == "rmsnorm":
            return self.weight * normed.to(x.dtype)
        if self.kind == "gemma_rmsnorm":
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return (self.weight.float() * normed).to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The model's norm over `dim` features (the hidden size by default)."""
    if cfg.norm == "layernorm":
        return nn.LayerNorm(dim or cfg.hidden_size, eps=cfg.norm_eps)
    return RMSNorm(dim or cfg.hidden_size, cfg.norm_eps, cfg.norm)


def activate(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


class MLP(nn.Module):
    """SwiGLU (gate and up fused into one matmul) or a plain two-layer GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        self.activation = cfg.activation
        self.intermediate_size = cfg.intermediate_size
        width = 2 * cfg.intermediate_size if self.gated else cfg.intermediate_size
        if self.gated:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        else:
            self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # 2 x (T, I)
            return self.down_proj(activate(gate, self.activation) * up)
        return self.down_proj(activate(self.up_proj(x), self.activation))
