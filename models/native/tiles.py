"""Whether this process may use AMX tiles, asked safely before the `amx` level is chosen.

Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), and only where the
OS enabled it in XCR0. A CPU that lists amx_* in /proc/cpuinfo while its kernel or hypervisor refuses
the tiles faults on the first tile instruction (SIGILL): llama.cpp's AMX build does, in such a VM. So
the level is `amx` only after the request was granted and one tile operation ran in a child process;
otherwise one warning says why, and the level below serves. No torch here: it runs before torch does.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from models.native.cache import cache_dir, cache_lock

logger = logging.getLogger(__name__)

AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8"})
SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1021, 0x1022, 0x1023
XFEATURE_XTILEDATA = 18

# One 16 x 64-byte tile configured, zeroed, stored and released: the steps a tile kernel takes first.
PROBE_SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  alignas(64) unsigned char config[64] = {};
  config[0] = 1;  // palette 1
  config[16] = 64;  // tile 0: 64 bytes per row
  config[48] = 16;  // 16 rows
  _tile_loadconfig(config);
  _tile_zero(0);
  alignas(64) int out[256];
  for (int& v : out) v = 1;
  _tile_stored(0, out, 64);
  _tile_release();
  for (int v : out) if (v != 0) return 3;
  return 0;
}
"""


@dataclass(frozen=True)
class TileGrant:
    granted: bool
    reason: str  # "granted", or why not

    def __str__(self) -> str:
        return self.reason


def _arch_prctl(code: int, arg: int | ctypes.c_uint64) -> tuple[int, int]:
    """(result, errno) of arch_prctl(code, arg); arg is a number, or a uint64 the kernel writes to."""
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.byref(arg) if isinstance(arg, ctypes.c_uint64) else ctypes.c_ulong(arg)
    return libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), value), ctypes.get_errno()


def request_tiles() -> TileGrant:
    """Ask the kernel for the tile state (for this process; children inherit it), and check it was granted."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return TileGrant(False, "not x86-64 Linux")
    supported = ctypes.c_uint64()
    result, errno = _arch_prctl(ARCH_GET_XCOMP_SUPP, supported)
    if result != 0:
        return TileGrant(False, f"the kernel has no extended-state permissions ({os.strerror(errno)})")
    if not supported.value >> XFEATURE_XTILEDATA & 1:
        return TileGrant(False, "the OS did not enable the tile state (XCR0)")
    result, errno = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if result != 0:
        return TileGrant(False, f"the kernel refused the tile permission ({os.strerror(errno)})")
    permitted = ctypes.c_uint64()
    result, _ = _arch_prctl(ARCH_GET_XCOMP_PERM, permitted)
    if result != 0 or not permitted.value >> XFEATURE_XTILEDATA & 1:
        return TileGrant(False, "the tile permission was not granted")
    return TileGrant(True, "granted")


def _probe_binary() -> Path | None:
    """The probe program, compiled once per compiler into the cache; None without a compiler."""
    compiler = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    key = hashlib.sha256((PROBE_SOURCE + version).encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"amx-probe-{key}"
    if path.exists():
        return path
    with cache_lock(f"native-{path.name}"):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                source, out = Path(tmp) / "probe.cpp", Path(tmp) / path.name
                source.write_text(PROBE_SOURCE)
                built = subprocess.run([compiler, "-O1", "-mamx-tile", str(source), "-o", str(out)],
                                       capture_output=True, text=True, timeout=120)
                if built.returncode != 0:
                    return None
                out.replace(path)  # NOTE: atomic within one directory
    return path


def run_tile_probe() -> TileGrant:
    """One tile operation in a child process: a fault there costs the child, never this process."""
    binary = _probe_binary()
    if binary is None:
        return TileGrant(True, "granted (no compiler to run a tile probe; the permission alone was checked)")
    child = subprocess.run([str(binary)], capture_output=True, timeout=60)
    if child.returncode == 0:
        return TileGrant(True, "granted")
    if child.returncode < 0:
        return TileGrant(False, f"a tile operation faulted in a child process (signal {-child.returncode})")
    return TileGrant(False, f"the tile probe failed (exit {child.returncode})")


@functools.cache
def tile_grant() -> TileGrant:
    """Once per process: the permission, then the probe. A refusal is one warning."""
    grant = request_tiles()
    if grant.granted:
        grant = run_tile_probe()
    if not grant.granted:
        logger.warning("attnserve: this CPU lists AMX but %s; AMX stays off, the level below serves", grant.reason)
    return grant
