"""`attnserve eval`'s rows kept in the cache, so the dashboard shows quality against KV size
without computing anything at request time. No torch: the API layer reads it."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

KEY = ("model", "kv_cache_dtype")  # a later run of the same model and KV dtype replaces the row


def results_path() -> Path:
    root = Path(os.environ.get("ATTNSERVE_CACHE_DIR", Path.home() / ".cache" / "attnserve"))
    return root / "eval" / "results.json"


def load() -> list[dict]:
    try:
        rows = json.loads(results_path().read_text())
    except (OSError, ValueError):
        return []
    return rows if isinstance(rows, list) else []


def save(rows: list[dict]) -> Path:
    """Merge `rows` into the results file (atomically)."""
    merged = {tuple(r.get(k) for k in KEY): r for r in load()}
    merged.update({tuple(r[k] for k in KEY): r for r in rows})
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(list(merged.values()), f, indent=2)
    os.replace(f.name, path)
    return path
