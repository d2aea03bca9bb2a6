"""attnserve's cache directory (converted checkpoints, C++ libraries, inductor's code) and its locks."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def cache_dir() -> Path:
    return Path(os.environ.get("ATTNSERVE_CACHE_DIR", Path.home() / ".cache" / "attnserve"))


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Serialise first-use work across processes (several replicas may start at once)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
