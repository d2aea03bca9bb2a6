"""`attnserve env`: what a bug report needs (as `vllm collect-env` does): the CPU and its ISA
level, the cap, torch / oneDNN / compiler versions, our kernels, and the paths chosen here."""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch

from kvcache import ops
from models.native.cpu_features import ISA_LEVELS, amx_listed, isa_cap, machine_isa, read_cpu_features
from models.native.cpu_path import ACTIVATIONS, DTYPES, INT8_KERNELS, choose_cpu_path, int8_code_bits, prompt_kernel
from models.native.probe import detect
from models.native.tiles import tile_grant
from models.native.toolchain import SOURCES, compiler_version, library_path
from server.engine.compilation import inductor_cache_dir

ENV_VARS = ("ATTNSERVE_CPU_ISA", "ATTNSERVE_NATIVE", "ATTNSERVE_CACHE_DIR", "ATEN_CPU_CAPABILITY",
            "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "CXX")
# Flags that decide a level or a kernel; the whole list is in the report too
KEY_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
             "avx512_vnni", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16", "i8mm")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _onednn_version(torch) -> str:
    for line in torch.__config__.show().splitlines():  # e.g. "- Intel(R) MKL-DNN v3.12.0 (Git Hash ...)"
        if "DNN v" in line:
            return line.split("DNN ", 1)[1].split(" (")[0]
    return "none"


def collect() -> dict:
    features = read_cpu_features()
    isa = machine_isa()
    caps = detect("cpu")
    try:
        compiler = compiler_version()
        paths = {name: library_path(name, isa) for name in SOURCES}
        libraries = {name: {"path": str(path), "built": path.exists()} for name, path in paths.items()}
    except RuntimeError as e:
        compiler, libraries = f"none ({e})", {}
    # what the engine would choose for a bf16 checkpoint (the default model) and an fp32 one
    paths = {f"{source} checkpoint, --dtype {dtype}": choose_cpu_path(
        caps, dtype, source, source == "bfloat16", torch.get_num_threads()).describe()
        for source in ("bfloat16", "float32") for dtype in DTYPES}
    # what the quantized linears' activations would be (a GGUF such as the default model's Q4_1)
    paths |= {f"quantized checkpoint, --activations {mode}": ", ".join(
        f"{bits}-bit codes {INT8_KERNELS[isa] if bits in int8_code_bits(caps, mode) else 'exact'}"
        for bits in (4, 8)) + (f", prompt tokens {prompt_kernel(caps, mode)}" if prompt_kernel(caps, mode) else "")
        for mode in ACTIVATIONS}
    return {
        "attnserve": _version("attnserve"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": {"model": features.model, "arch": features.arch, "cores": os.cpu_count(),
                "key_flags": sorted(f for f in KEY_FLAGS if f in features.flags), "flags": sorted(features.flags)},
        "isa": {"cpu_level": features.isa, "cap": isa_cap(), "chosen": isa, "levels": list(ISA_LEVELS),
                "amx_tiles": str(tile_grant()) if amx_listed(features) else "not listed"},
        "torch": {"version": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "onednn": _onednn_version(torch),
                  "onednn_packs": sorted(caps.onednn_dtypes), "num_threads": torch.get_num_threads(),
                  "cuda": torch.version.cuda or "none"},
        "compiler": compiler,
        "kernels": {"attention": ops.cpu_backend(), "panel_linear": caps.panel_kernel, "libraries": libraries},
        "inductor_cache": str(inductor_cache_dir()),
        "paths": paths,
        "packages": {p: _version(p) for p in ("ray", "transformers", "tokenizers", "numpy")},
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def render(report: dict) -> str:
    cpu, isa, torch_ = report["cpu"], report["isa"], report["torch"]
    lines = [
        f"attnserve {report['attnserve']}, Python {report['python']}, {report['platform']}",
        f"CPU: {cpu['model']} ({cpu['arch']}, {cpu['cores']} cores)",
        f"  flags that matter: {' '.join(cpu['key_flags']) or '-'}",
        f"ISA level: CPU {isa['cpu_level']}, cap {isa['cap']} -> {isa['chosen']} (AMX tiles: {isa['amx_tiles']})",
        f"torch {torch_['version']} (capability {torch_['cpu_capability']}, CUDA {torch_['cuda']}), "
        f"oneDNN {torch_['onednn']} packs {', '.join(torch_['onednn_packs']) or 'nothing'}, "
        f"{torch_['num_threads']} threads",
        f"compiler: {report['compiler']}",
        f"kernels: attention {report['kernels']['attention']}, panel linear "
        f"{'loaded' if report['kernels']['panel_linear'] else 'unavailable'}",
    ]
    lines += [f"  {name}: {lib['path']}{'' if lib['built'] else ' (not built yet)'}"
              for name, lib in report["kernels"]["libraries"].items()]
    lines.append(f"inductor cache: {report['inductor_cache']}")
    lines.append("paths chosen here:")
    lines += [f"  {what}: {path}" for what, path in report["paths"].items()]
    lines.append("packages: " + ", ".join(f"{k} {v}" for k, v in report["packages"].items()))
    lines.append("environment: " + (", ".join(f"{k}={v}" for k, v in report["env"].items()) or "-"))
    lines.append(f"all CPU flags: {' '.join(cpu['flags'])}")
    return "\n".join(lines)
