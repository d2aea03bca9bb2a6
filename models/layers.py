"""Norms and MLPs shared by every architecture."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


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
