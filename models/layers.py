"""Norms and MLPs shared by every architecture."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.lora import LoraStep


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

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which LoRA deltas are this layer's
        self.gated = cfg.mlp == "swiglu"
        self.activation = cfg.activation
        self.intermediate_size = cfg.intermediate_size
        width = 2 * cfg.intermediate_size if self.gated else cfg.intermediate_size
        if self.gated:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        else:
            self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        """`lora`: each adapter row's delta, added to gate|up (or up) before the activation and to down's output."""
        up_proj = self.gate_up_proj if self.gated else self.up_proj
        up = up_proj(x)  # (T, 2 I) or (T, I)
        if lora is not None:
            up = lora.apply(self.layer_idx, "gate_up", x, up)
        if self.gated:
            gate, up = up.split(self.intermediate_size, dim=-1)  # 2 x (T, I)
            act = activate(gate, self.activation) * up
        else:
            act = activate(up, self.activation)
        if lora is None:
            return self.down_proj(act)
        return lora.apply(self.layer_idx, "down", act, self.down_proj(act))
