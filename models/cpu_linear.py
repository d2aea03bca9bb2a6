"""CPU linears: which matmul each nn.Linear runs, swapped in once at load (models/cpu_path.py chooses).

* `onednn`: weights reordered once into oneDNN's blocked layout run the same matmuls much
  faster than `F.linear` here: bf16 about 1.7x at batch 1, fp32 2-4x at every batch size (MKL's
  sgemm takes a slow path on AMD CPUs; oneDNN does not). oneDNN packs bf16 only where the CPU
  has AVX-512 (or AVX-NE-CONVERT); elsewhere it refuses.
* `panels`: bf16 weights kept bf16, in panels (models/csrc/linear.cpp): widened to fp32 in
  registers for fp32 activations (half the bytes of fp32 weights per decode step, exactly the fp32
  results), multiplied as bf16 pairs for bf16 activations on AVX512-BF16.
* `torch`: `F.linear` as it is.

Inductor can use oneDNN's kernels only on frozen weights, and freezing defeats its on-disk
cache, so each packed call is an opaque custom op instead.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

LINEAR_PATHS = ("onednn", "panels", "torch")

_LIB = torch.library.Library("attnserve", "FRAGMENT")
_LIB.define("panel_linear(Tensor x, Tensor packed, Tensor? bias, SymInt out_features) -> Tensor")
_LIB.define("pack_panels(Tensor weight) -> Tensor")


@torch.library.register_fake("attnserve::panel_linear")
def _(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("attnserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ W^T + b, W in oneDNN's opaque layout (logical shape (out, in))."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders weights of this dtype here (it checks the CPU, and its ISA cap)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


@functools.cache
def panel_library() -> str:
    """Load the panel-linear kernel for this CPU's level (raises without a compiler)."""
    from models.native import load

    return load("panel_linear")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 32),
                             persistent=False)  # opaque layout
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnserve.packed_linear(x, self.packed, self.bias)


class PanelLinear(nn.Module):
    """bf16 weights in panels (models/csrc/linear.cpp); x and the output keep x's dtype.

    NOTE: narrowing to bf16 is exact only for weights that were bf16 already; the caller
    (models/cpu_path.py) takes this path for fp32 compute only for bf16 checkpoints."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        panel_library()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.attnserve.pack_panels(linear.weight.detach()),
                             persistent=False)  # (panels, in / 2, 2 W) bf16
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnserve.panel_linear(x, self.packed, self.bias, self.out_features)


_SWAPS = {"onednn": PackedLinear, "panels": PanelLinear}


def pack_linears(model: nn.Module, path: str) -> int:
    """Swap every nn.Linear for the chosen path's module in place (CPU only); returns how many."""
    if path not in LINEAR_PATHS:
        raise ValueError(f"unknown linear path {path!r}; choose from {', '.join(LINEAR_PATHS)}")
    if path == "torch":
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, _SWAPS[path](child))
    return len(swaps)
