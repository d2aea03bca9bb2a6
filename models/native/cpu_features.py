"""What this CPU can run, and the ISA level attnserve builds and chooses its CPU paths for.

The level is the CPU's own (from /proc/cpuinfo), lowered by a cap: `ATTNSERVE_CPU_ISA`, or
torch's and oneDNN's own caps (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`) where a user set
those. `apply_isa_cap` makes torch and oneDNN follow ATTNSERVE_CPU_ISA. No torch here: that has
to happen before torch runs its first kernel.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, MutableMapping

from models.native.tiles import AMX_FLAGS, tile_grant

ISA_LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")  # each includes the ones before it
ISA_CAPS = ("auto", *ISA_LEVELS)
CAP_ENV = "ATTNSERVE_CPU_ISA"
EMULATION_ENV = "ATTNSERVE_AMX_EMULATION"

logger = logging.getLogger(__name__)

# The /proc/cpuinfo flags each x86 level adds to the one below (x86-64-v3 and -v4, then BF16 with the
# VNNI every BF16 CPU has: Cooper Lake, Sapphire Rapids and later, Zen 4 and later; then AMX's tiles,
# Sapphire Rapids and later, which count only once the kernel granted them: tiles.py).
_LEVEL_FLAGS = {
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    "avx512_bf16": frozenset({"avx512_bf16", "avx512_vnni"}),
    "amx": AMX_FLAGS,
}
# What torch's own kernels (ATEN_CPU_CAPABILITY) and oneDNN (ONEDNN_MAX_CPU_ISA) may use per level.
_TORCH_CAPABILITY = {"generic": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512"}
_ONEDNN_ISA = {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "avx512_bf16": "AVX512_CORE_BF16",
               "amx": "AVX512_CORE_AMX"}


@dataclass(frozen=True)
class CpuFeatures:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str
    flags: frozenset[str]

    @property
    def is_x86(self) -> bool:
        """The ISA levels above generic are x86's; every other architecture has the one level."""
        return self.arch in ("x86_64", "AMD64")

    @property
    def isa(self) -> str:
        """The highest level whose flags (and those of every level below) this CPU has."""
        if not self.is_x86:
            return "generic"
        level, needed = "generic", frozenset()
        for name in ISA_LEVELS[1:]:
            needed |= _LEVEL_FLAGS[name]
            if not needed <= self.flags:
                break
            level = name
        return level

    @property
    def key(self) -> str:
        """Names everything compiled for exactly this CPU (inductor's cache)."""
        return hashlib.sha256(" ".join([self.arch, *sorted(self.flags)]).encode()).hexdigest()[:12]


def parse_cpuinfo(text: str, arch: str) -> CpuFeatures:
    """/proc/cpuinfo's first processor: its flags (x86) or Features (ARM) and its name."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    flags = fields.get("flags") or fields.get("features") or ""
    model = fields.get("model name") or fields.get("cpu model") or fields.get("cpu part") or arch
    return CpuFeatures(arch, model, frozenset(flags.split()))


def read_cpu_features() -> CpuFeatures:
    arch = platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return CpuFeatures(arch, platform.processor() or arch, frozenset())
    return parse_cpuinfo(text, arch)


def _level_of_torch_capability(value: str) -> str | None:
    return {"default": "generic", "avx2": "avx2"}.get(value.strip().lower())


def _level_of_onednn_isa(value: str) -> str | None:
    v = value.strip().upper()
    if v in ("", "ALL", "DEFAULT") or v.startswith("AVX10"):
        return None
    if v.startswith("AVX512_CORE_AMX"):
        return "amx"
    if v.startswith("AVX512_CORE_BF16") or v.startswith("AVX512_CORE_FP16"):
        return "avx512_bf16"
    if v.startswith("AVX512"):
        return "avx512"
    if v.startswith("AVX2"):
        return "avx2"
    return "generic"  # SSE41, AVX, AVX_VNNI...


def isa_cap(environ: Mapping[str, str] = os.environ) -> str:
    cap = environ.get(CAP_ENV, "auto").strip().lower() or "auto"
    if cap not in ISA_CAPS:
        raise ValueError(f"{CAP_ENV}={cap!r}: choose one of {', '.join(ISA_CAPS)}")
    return cap


def choose_isa(features: CpuFeatures, environ: Mapping[str, str] = os.environ, tiles: bool = False) -> str:
    """The CPU's level, lowered by every cap in the environment (never raised by one). `tiles`: the
    kernel granted AMX's tiles (tiles.tile_grant); without them a CPU listing AMX is avx512_bf16."""
    own = "avx512_bf16" if features.isa == "amx" and not tiles else features.isa
    caps = [own]
    cap = isa_cap(environ)
    if cap != "auto":
        caps.append(cap)
    caps.append(_level_of_torch_capability(environ.get("ATEN_CPU_CAPABILITY", "")) or own)
    caps.append(_level_of_onednn_isa(environ.get("ONEDNN_MAX_CPU_ISA", "")) or own)
    return min(caps, key=ISA_LEVELS.index)


def amx_listed(features: CpuFeatures, environ: Mapping[str, str] = os.environ) -> bool:
    """The CPU lists AMX and no cap rules it out: the tiles must be asked for before anything runs."""
    return features.is_x86 and AMX_FLAGS <= features.flags and isa_cap(environ) in ("auto", "amx")


def torch_isa_env(isa: str, features: CpuFeatures) -> dict[str, str]:
    """ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA for a level (x86 only: elsewhere there is one level)."""
    if not features.is_x86:
        return {}
    return {"ATEN_CPU_CAPABILITY": _TORCH_CAPABILITY[isa], "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[isa]}


# -march for code built at a level below the CPU's own (x86). At the CPU's own level, inductor
# keeps its default (-march=native) and its cache is named by the CPU's flags (features.key).
_MARCH = {"amx": "x86-64-v4", "avx512_bf16": "x86-64-v4", "avx512": "x86-64-v4", "avx2": "x86-64-v3", "generic": "x86-64"}


def capped_march(isa: str, features: CpuFeatures) -> str | None:
    """The -march that keeps generated code at `isa`, where that is below the CPU's level."""
    if not features.is_x86 or isa == features.isa:
        return None
    return _MARCH[isa]


def apply_isa_cap(environ: MutableMapping[str, str] = os.environ) -> str:
    """Make torch and oneDNN follow ATTNSERVE_CPU_ISA (when set), or stay off AMX's tiles where they
    were refused (oneDNN would use them); returns the level chosen.

    Call it before torch runs a kernel: both read their caps once, on first use."""
    features = read_cpu_features()
    isa = machine_isa(environ)
    # NOTE: tiles listed but refused: oneDNN must not find them on its own (a fault, not a fallback)
    if isa_cap(environ) != "auto" or (features.isa == "amx" and isa != "amx"):
        environ.update(torch_isa_env(isa, features))
    return isa


def amx_emulated(features: CpuFeatures, environ: Mapping[str, str] = os.environ) -> bool:
    """ATTNSERVE_AMX_EMULATION=1 on an AVX512-BF16 CPU without AMX: the amx level, its tile instructions in
    software (models/csrc/amx_tiles.h). For tests, so that the amx build's kernels run on CPUs without
    tiles: slow, never a way to serve."""
    return environ.get(EMULATION_ENV, "") == "1" and features.isa == "avx512_bf16"


@functools.cache
def _warn_emulated() -> None:
    logger.warning("attnserve: %s=1: the amx level's tiles are emulated in software (tests only: slow)", EMULATION_ENV)


def machine_isa(environ: Mapping[str, str] = os.environ) -> str:
    """This process's level: the CPU's own (AMX only where the tiles were granted, or emulated), lowered by
    the caps in its environment."""
    features = read_cpu_features()
    if amx_emulated(features, environ):
        _warn_emulated()
        return choose_isa(replace(features, flags=features.flags | AMX_FLAGS), environ, tiles=True)
    return choose_isa(features, environ, tiles=amx_listed(features, environ) and tile_grant().granted)
