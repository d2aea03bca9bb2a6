"""Builds and loads the C++ paged-attention kernel (kvcache/csrc) once per machine.

The shared library lands in the attnserve cache, named by a hash of everything that shapes
it (source, flags, torch version, compiler, CPU features), so a rebuild happens only when one
of those changes. `make install` builds it ahead of time (`python -m kvcache.native`); otherwise
the first import does. Never during a request.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-DNDEBUG"]


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), platform.machine())


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def library_path() -> Path:
    from models.registry import cache_dir

    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"no C++ compiler ({compiler}): {e}") from e
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), torch.__version__, version,
                                    _cpu_features(), sys.version]).encode()).hexdigest()[:16]
    return cache_dir() / "native" / f"paged_attention-{key}.so"


def _command(out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    libs = [f"-L{p}" for p in library_paths()]
    return [_compiler(), *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(SOURCE), "-o", str(out),
            *libs, "-lc10", "-ltorch_cpu", "-ltorch"]


def build() -> Path:
    """The library's path, compiling it first if this machine has none yet (raises if it cannot)."""
    from models.registry import cache_lock

    path = library_path()
    if path.exists():
        return path
    with cache_lock("native-build"):
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"attnserve: compiling the paged-attention kernel into {path} (once per machine)...",
              file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            proc = subprocess.run(_command(out), capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr[-4000:]}")
            shutil.move(str(out), path)  # NOTE: atomic within one directory: readers never see half a file
    return path


if __name__ == "__main__":
    print(build())
