"""Memory the process gives back to the OS."""
from __future__ import annotations

import ctypes
import ctypes.util


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
