"""CPU linears: which matmul each nn.Linear runs, swapped in once at load (models/native/cpu_path.py chooses).

* `onednn`: weights reordered once into oneDNN's blocked layout run the same matmuls much
  faster than `F.linear` here: bf16 about 1.7x at batch 1, fp32 2-4x at every batch size (MKL's
  sgemm takes a slow path on AMD CPUs; oneDNN does not). oneDNN packs bf16 only where the CPU
  has AVX-512 (or AVX-NE-CONVERT); elsewhere it refuses.
* `panels`: bf16 weights kept bf16, in panels (models/csrc/linear.cpp): widened to fp32 in
  registers for fp32 activations (half the bytes of fp32 weights per decode step, exactly the fp32
  results), multiplied as bf16 pairs for bf16 activations on AVX512-BF16.
* `amx-bf16`: the same oneDNN packed matmuls in bf16 at the amx level, where oneDNN runs them on
  AMX's tiles (measured on an AMX Xeon: faster than our panels at every M, 1.5x at one token and 10x
  at 512; docs/benchmarks.md, "A third kind of machine").
* `torch`: `F.linear` as it is.

Inductor can use oneDNN's kernels only on frozen weights, and freezing defeats its on-disk
cache, so each packed call is an opaque custom op instead.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from models.native.cpu_path import INT8_KERNELS, CpuCapabilities, CpuPath, choose_cpu_path, prompt_kernel, resolve_dtype
from models.native.libraries import load
from models.quant_linear import QuantLinear

LINEAR_PATHS = ("onednn", "amx-bf16", "panels", "torch")

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
    (models/native/cpu_path.py) takes this path for fp32 compute only for bf16 checkpoints."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        load("panel_linear")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.attnserve.pack_panels(linear.weight.detach()),
                             persistent=False)  # (panels, in / 2, 2 W) bf16
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnserve.panel_linear(x, self.packed, self.bias, self.out_features)


_SWAPS = {"onednn": PackedLinear, "amx-bf16": PackedLinear, "panels": PanelLinear}


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


def prepare(model, caps: CpuCapabilities, requested: str, checkpoint_dtype: str, device: str = "cpu",
            activations: str = "auto") -> CpuPath:
    """Choose the model's path and swap its linears in; a model is prepared once (`model.cpu_path`).
    `activations`: as asked of the quantized linears (models/native/cpu_path.py ACTIVATIONS)."""
    if model.cpu_path is not None:
        return model.cpu_path
    dtype = resolve_dtype(caps, requested, checkpoint_dtype, device)
    # checked only where it can matter: a float32 model on a machine with the panel kernel
    fits = dtype == "float32" and caps.panel_kernel and fits_bf16(
        m.weight for m in model.modules() if isinstance(m, nn.Linear))
    path = choose_cpu_path(caps, requested, checkpoint_dtype, fits, torch.get_num_threads(), device)
    if path.dtype != str(model.dtype).removeprefix("torch."):
        raise ValueError(f"the model is {model.dtype}, its path computes in {path.dtype}")
    if not any(isinstance(m, nn.Linear) for m in model.modules()):  # every linear quantized (a GGUF)
        path = dataclasses.replace(path, linear="quantized", weight_dtype=model.quantization)
    elif device == "cpu":
        pack_linears(model, path.linear)
    int8 = _activations(model, caps)
    model.cpu_path = dataclasses.replace(path, quantization=model.quantization, activations=int8,
                                         prompt_activations=prompt_kernel(caps, activations) if int8 != "exact" else "")
    return path


def _activations(model, caps: CpuCapabilities) -> str:
    """exact, or the integer kernel that runs the int8-activation linears (models/quant_linear.py), with
    "+exact" where other quantized linears (e.g. a Q4_1 file's Q8_0 ones) keep exact activations."""
    int8 = {m.int8_activations for m in model.modules() if isinstance(m, QuantLinear)}
    if True not in int8:
        return "exact"
    return INT8_KERNELS[caps.isa] + ("+exact" if False in int8 else "")


def fits_bf16(weights) -> bool:
    """Whether every tensor holds only bf16 values (then storing it as bf16 loses nothing)."""
    for w in weights:
        if w.dtype != torch.bfloat16 and not torch.equal(w.to(torch.bfloat16).to(w.dtype), w):
            return False
    return True
