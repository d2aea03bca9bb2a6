"""What this process can run: the probes behind `CpuCapabilities` (cpu_path.py chooses from them)."""
from __future__ import annotations

import torch

from models.native.cpu_features import machine_isa
from models.native.cpu_path import CpuCapabilities
from models.native.libraries import available, load, native_enabled


def attention_backend() -> str:
    """What serves CPU attention: "native-<ISA level>" (the C++ paged kernel, loaded here) or "sdpa"."""
    if native_enabled() and available("paged_attention"):
        return f"native-{load('paged_attention')}"
    return "sdpa"


def onednn_packs(dtype) -> bool:
    """Whether oneDNN reorders weights of this torch dtype here (it checks the CPU, and its ISA cap)."""

    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def detect(device: str = "cpu") -> CpuCapabilities:
    """This process's capabilities: the ISA level, oneDNN's probe, our kernels' build."""

    isa = machine_isa()
    if device != "cpu":
        return CpuCapabilities(isa, frozenset(), False, "cuda")
    attention = attention_backend()
    # ATTNSERVE_NATIVE=0 or no compiler: no C++ kernel at all
    panels = attention != "sdpa" and available("panel_linear")
    onednn = frozenset(name for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
                       if onednn_packs(dt))
    return CpuCapabilities(isa, onednn, panels, attention)
