"""Run a peer as if on a CPU of a lower ISA level (bench_engine.py, under ATTNSERVE_CPU_ISA).

Python imports this module at start-up in every process of a peer run (bench_engine puts this
folder on PYTHONPATH and sets ATTNSERVE_PEER_ISA): torch's CPU feature checks then answer as that
CPU's would, so a peer that picks its kernels by them (vLLM: `_C_AVX2` or `_C_AVX512`, its
attention ISA) takes that CPU's builds, as ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA make torch
and oneDNN do. Never imported by attnserve itself.
"""
import os

_LEVEL = os.environ.get("ATTNSERVE_PEER_ISA", "")
if _LEVEL in ("generic", "avx2", "avx512"):
    import torch.cpu

    def _no() -> bool:
        return False

    for name in ("_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_avx512_bf16_supported"):
        setattr(torch.cpu, name, _no)
    if _LEVEL != "avx512":
        torch.cpu._is_avx512_supported = _no
        torch.cpu._is_avx512_vnni_supported = _no
