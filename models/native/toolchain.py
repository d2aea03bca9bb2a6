"""Compiles attnserve's C++ CPU kernels: one library per source and ISA level.

Each library is compiled for an explicit level (never `-march=native`), and its file name
carries the level and a hash of everything else that shapes it (source, the shared header, flags,
torch, compiler, Python): a cache directory shared between machines (an NFS home, a container image
built elsewhere) never hands a CPU code with instructions it lacks, because the level is chosen
from the CPU's own features at run time (cpu_features.py). `make install` builds this machine's
libraries ahead of time (`python -m models.native`, side by side on every core; `--all` builds
every level, for an image that runs on other machines); otherwise the first `libraries.load`
does, never a request.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from models.native.cache import cache_dir, cache_lock
from models.native.cpu_features import amx_emulated, machine_isa, read_cpu_features

ROOT = Path(__file__).resolve().parents[2]
# the table of every library lives here, at the bottom, so `make install` builds them all
# without importing the modules above that call them
SOURCES = {
    "paged_attention": ROOT / "kvcache" / "csrc" / "paged_attention.cpp",
    "panel_linear": ROOT / "models" / "csrc" / "linear.cpp",
    "quant_linear": ROOT / "models" / "csrc" / "quant_linear.cpp",
    "q8_linear": ROOT / "models" / "csrc" / "q8_linear.cpp",
    "decoder": ROOT / "models" / "csrc" / "decoder.cpp",
    "shm_comm": ROOT / "models" / "csrc" / "shm_comm.cpp",
    "logit_scores": ROOT / "models" / "csrc" / "logit_scores.cpp",
    "lora": ROOT / "models" / "csrc" / "lora.cpp",
}
# The headers the kernel files include (simd.h: the vector types, the ISA preamble and the register
# tiles; quant_panels.h: the quantized panels): every library's name hashes them all
HEADER_DIR = ROOT / "models" / "csrc"
HEADERS = sorted(HEADER_DIR.glob("*.h"))
FLAGS = ["-O3", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-DNDEBUG"]
# Per library. paged_attention, quant_linear: their ways through for few and many rows must round alike,
# row for row (batch invariance), so only the multiply-adds they spell out (simd.h fmadd) are fused,
# never where the compiler chooses to
SOURCE_FLAGS = {name: ["-ffp-contract=off"] for name in ("paged_attention", "quant_linear", "q8_linear")}
# x86-64-v3 is AVX2 + FMA + F16C + BMI; -v4 adds AVX-512 F/BW/CD/DQ/VL. The portable build has
# no -march at all: the compiler's baseline (SSE2 on x86-64, NEON on aarch64).
# The libraries with tile code (q8_linear: AMX int8 tiles for many rows; paged_attention: q.k on bf16
# tiles); the others' amx level loads their avx512_bf16 build (oneDNN's kernels use the tiles there)
TILE_LIBRARIES = frozenset({"q8_linear", "paged_attention"})
BUILD_LEVEL = {"amx": "avx512_bf16"}
ISA_FLAGS = {
    "amx": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
    "avx512": ["-march=x86-64-v4"],
    "avx2": ["-march=x86-64-v3"],
    "generic": [],
}


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def compiler_version() -> str:
    """The compiler's first line of `--version`; raises if there is none."""
    return _version_of(_compiler())


@functools.cache
def _version_of(compiler: str) -> str:
    # every library's name hashes it: asked once per compiler, not once per library
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"no C++ compiler ({compiler}): {e}") from e
    return out.splitlines()[0] if out else compiler


def build_level(name: str, isa: str) -> str:
    """The level `name` is compiled for when this process runs at `isa`."""
    return isa if name in TILE_LIBRARIES else BUILD_LEVEL.get(isa, isa)


def flags(name: str, isa: str) -> list[str]:
    level = build_level(name, isa)
    isa_flags = ISA_FLAGS[level]
    if level == "amx" and amx_emulated(read_cpu_features()):  # the tiles in software (amx_tiles.h)
        isa_flags = ISA_FLAGS["avx512_bf16"] + ["-DATTNSERVE_AMX_EMULATED"]
    return FLAGS + SOURCE_FLAGS.get(name, []) + isa_flags


def library_path(name: str, isa: str) -> Path:
    """Where the library for `isa` lives, named by the level it is built for."""
    isa = build_level(name, isa)
    key = hashlib.sha256("\0".join([SOURCES[name].read_text(), *(h.read_text() for h in HEADERS), " ".join(flags(name, isa)), torch.__version__,
                                    compiler_version(), sys.version]).encode()).hexdigest()[:16]
    return cache_dir() / "native" / f"{name}-{isa}-{key}.so"


def command(name: str, isa: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths  # noqa: PLC0415 - cpp_extension imports setuptools: only where a library compiles

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in [HEADER_DIR, *include_paths(), sysconfig.get_paths()["include"]]]
    libs = [f"-L{p}" for p in library_paths()]
    return [_compiler(), *flags(name, isa), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(SOURCES[name]),
            "-o", str(out), *libs, "-lc10", "-ltorch_cpu", "-ltorch"]


def build(name: str, isa: str | None = None) -> Path:
    """The library's path for `isa` (default: this machine's), compiling it first if needed."""
    isa = isa or machine_isa()
    path = library_path(name, isa)
    if path.exists():
        return path
    with cache_lock(f"native-{path.stem}"):  # NOTE: one lock per library: builds of others run beside it
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"attnserve: compiling {SOURCES[name].name} for {isa} into {path} (once per machine)...",
              file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            proc = subprocess.run(command(name, isa, out), capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {SOURCES[name].name} failed:\n{proc.stderr[-4000:]}")
            shutil.move(str(out), path)  # NOTE: atomic within one directory: readers never see half a file
    return path


def build_all(levels: list[str | None] | None = None, names: list[str] | None = None) -> list[Path]:
    """Every library at every level in `levels` (default: this machine's), one compiler per core:
    the sources take 7-30 s each to compile, so one at a time leaves cores idle."""

    names = list(names or SOURCES)
    jobs = [(name, level) for level in (levels or [None]) for name in names]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda job: build(*job), jobs))


def host_levels() -> list[str]:
    """Every level this host's compiler can build (x86: all four; elsewhere: the portable one)."""
    return list(ISA_FLAGS) if read_cpu_features().is_x86 else ["generic"]


def levels_from_argv(argv: list[str]) -> list[str | None]:
    """`--all`: every level; `--levels avx2,generic`: those this host can build; nothing: this machine's."""
    if "--all" in argv:
        return host_levels()
    if "--levels" in argv:
        return [level for level in argv[argv.index("--levels") + 1].split(",") if level in host_levels()]
    return [None]
