"""The built-in dashboard's data (`/dashboard/data`): the replicas' metrics snapshots (server/metrics.py),
per model."""
from __future__ import annotations

import time
from typing import Any

from server.kv_forms import KV_CURVE_LENGTHS, curve_lengths, kv_bytes_at, kv_forms
from server.metrics import (
    by_model,
    fresh,
    layer_windows,
    per_token_at,
    spec_counts,
    spec_totals,
    static_block_bytes,
    weights_of,
)


def _curve(static: dict) -> list[list[int]]:
    """[[tokens, KV bytes of one sequence of that many tokens], ...] from one block to 32k tokens (or
    the context, if longer): the dashboard's bytes-per-token lines and its capacity chart."""
    hi = max(KV_CURVE_LENGTHS[-1], static["max_model_len"])
    return [[n, kv_bytes_at(static["kv_bytes_per_token"], layer_windows(static), static["block_size"], n)]
            for n in curve_lengths(static["block_size"], hi)]


def _forms(static: dict, kv_heads: int) -> list[dict]:
    """MHA / GQA / MQA what-if rows for one replica's pool (older snapshots lack the head count)."""
    if not static.get("num_heads") or not static.get("num_blocks"):
        return []
    pool = static["num_blocks"] * static_block_bytes(static)
    return kv_forms(static["num_heads"], kv_heads, static["kv_bytes_per_token"], pool, static["block_size"],
                    layer_windows=layer_windows(static))


def _replicas_by_node(live: list[dict]) -> dict[str, list[str]]:
    nodes: dict[str, list[str]] = {}
    for snap in live:
        nodes.setdefault(snap.get("node", "local"), []).append(snap.get("replica", "?"))
    return {node: sorted(ids) for node, ids in sorted(nodes.items())}


def dashboard_data(snapshots: list[dict], now: float | None = None) -> dict[str, Any]:
    """Per model: static KV facts, live gauges, recent (seq_len, kv_bytes, ttft, itl, e2e) points and
    speculative decoding's counts."""
    now = time.time() if now is None else now
    models = []
    for (model, attention, kv_heads, kv_cache_dtype), snaps in sorted(by_model(snapshots).items()):
        live = fresh(snaps, now)
        static = snaps[0]["static"]
        recent = sorted((r for s in snaps for r in s["recent"]), key=lambda r: r[0])[-2000:]
        weights = weights_of(snaps) or (None, None)
        drafted, accepted = spec_counts(snaps)
        models.append({
            "model": model, "attention": attention, "kv_heads": int(kv_heads), "kv_cache_dtype": kv_cache_dtype,
            "kv_bytes_per_token": static["kv_bytes_per_token"], "block_size": static["block_size"],
            "max_model_len": static["max_model_len"],
            "layer_windows": list(layer_windows(static)), "kv_block_bytes": static_block_bytes(static),
            "attention_variants": static.get("attention_variants", []),
            "kv_bytes_per_token_at": {str(n): per_token_at(static, n) for n in KV_CURVE_LENGTHS},
            "kv_curve": _curve(static),
            "quantization": weights[0], "weight_bytes": weights[1],
            "kv_blocks_total": sum(s["gauges"]["kv_blocks_total"] for s in live),
            "kv_blocks_used": sum(s["gauges"]["kv_blocks_used"] for s in live),
            "requests_running": sum(s["gauges"]["requests_running"] for s in live),
            "replicas": len(live),
            # replicas report a "replica" and "node" (Ray ids) next to their counts
            "replicas_by_node": _replicas_by_node(live),
            # a sharded model's replicas list their ranks (tensor x pipeline parallel workers)
            "tensor_parallel_size": static.get("tensor_parallel_size", 1),
            "pipeline_parallel_size": static.get("pipeline_parallel_size", 1),
            "workers": [{**w, "replica": snap.get("replica", "?")} for snap in live for w in snap.get("workers", [])],
            "forms": _forms(static, int(kv_heads)),
            "speculative": static.get("speculative"),
            # None until a request drafted: the page shows acceptance only where there is some
            "spec_decode": {**spec_totals(drafted, accepted), "drafted_per_pos": drafted,
                            "accepted_per_pos": accepted} if drafted else None,
            "requests": [{"seq_len": r[0], "prompt_tokens": r[1], "output_tokens": r[2], "kv_bytes": r[3],
                          "ttft": r[4], "itl": r[5], "e2e": r[6]} for r in recent],
        })
    return {"time": now, "models": models}
