"""Memory the process gives back to the OS, and the cache hierarchy it runs on."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from pathlib import Path

import numpy as np

CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def release_freed_memory() -> None:
    """Hand the loader's freed buffers (unpacked codes, fp32 copies) back to the OS: glibc keeps
    them in its arenas otherwise, about 170 MB of the default model's resident memory."""

    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def drop_mapped_pages(array) -> None:
    """Unmap the pages of a view of a file's memory map (np.memmap), once read: mapped pages count in the
    process's resident memory, so a file read whole would add its size to what loading peaks at. The page
    cache keeps them: reading them again costs no I/O.

    NOTE: the range widens to whole 2 MiB, within the map: a file system of large folios (ext4 on recent
    kernels) maps a read in 2 MiB pieces, and a piece only partly dropped stayed mapped (~2 MB a matrix)."""
    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or array.nbytes == 0:  # NOTE: only a file's pages: dropped heap pages would read as zeros
        return
    lo, hi = base.ctypes.data, base.ctypes.data + base.nbytes
    start = max(lo // PAGE * PAGE, array.ctypes.data // HUGE_PAGE * HUGE_PAGE)
    end = min(hi, -(-(array.ctypes.data + array.nbytes) // HUGE_PAGE) * HUGE_PAGE)
    with contextlib.suppress(OSError, AttributeError):
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


PAGE, HUGE_PAGE = 4096, 2 << 20
MADV_DONTNEED = 4  # Linux


@functools.cache
def _libc():
    """NOTE: once: find_library runs ldconfig in a subprocess (2 ms), and the loader calls here per matrix."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def resident_bytes() -> tuple[int, int]:
    """This process's resident and peak resident bytes (VmRSS, VmHWM from Linux /proc; zeros elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0


def parse_cache_size(text: str) -> int:
    """sysfs's "32768K" (or "480M", "1G") in bytes."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def l3_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The last-level (L3) cache of the first CPU's socket, from Linux sysfs; None where it is not listed."""
    try:
        for index in sorted(caches.glob("index*")):
            if (index / "level").read_text().strip() == "3":
                return parse_cache_size((index / "size").read_text())
    except (OSError, ValueError):
        return None
    return None


CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")


def available_memory(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """Bytes this process can still take: the machine's MemAvailable, or less where a container (cgroup v2
    memory.max, v1 memory.limit_in_bytes) caps it below; None where neither says (not Linux)."""
    found = []
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        found.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = (cgroup / limit).read_text().strip()
            if cap != "max" and int(cap) < 1 << 60:  # v1 writes "no limit" as a huge number
                found.append(max(0, int(cap) - int((cgroup / usage).read_text())))
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None
