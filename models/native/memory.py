"""Memory the process gives back to the OS, and the cache hierarchy it runs on."""
from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def release_freed_memory() -> None:
    """Hand the loader's freed buffers (unpacked codes, fp32 copies) back to the OS: glibc keeps
    them in its arenas otherwise, about 170 MB of the default model's resident memory."""

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


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
