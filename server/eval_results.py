"""`attnserve eval`'s rows kept in the cache, so the dashboard shows quality against KV size
without computing anything at request time. No torch: the API layer reads it."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# a later run of the same model, KV dtype, weight format and activations replaces the row
KEY = ("model", "kv_cache_dtype", "quantization", "activations")
# rows written before weights could be quantized lack the field: their weights were served dequantized;
# before activations could be int8, they were exact
_MISSING = {"quantization": "none", "activations": "exact"}


def _key(row: dict) -> tuple:
    return tuple(row.get(k, _MISSING.get(k)) for k in KEY)


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
    merged = {_key(r): r for r in load()}
    merged.update({_key(r): r for r in rows})
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(list(merged.values()), f, indent=2)
    os.replace(f.name, path)
    return path
