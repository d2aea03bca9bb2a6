"""The built-in dashboard's data (`/dashboard/data`): the replicas' metrics snapshots (server/metrics.py),
per model."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from server.kv_forms import KV_CURVE_LENGTHS, curve_lengths, kv_bytes_at, kv_forms
from server.metrics import by_model, fresh, newest_info, per_token_at, pool_block_bytes, spec_counts, spec_totals
from server.wire import MetricsSnapshot, ModelInfo


def _curve(info: ModelInfo) -> list[list[int]]:
    """[[tokens, KV bytes of one sequence of that many tokens], ...] from one block to 32k tokens (or
    the context, if longer): the dashboard's bytes-per-token lines and its capacity chart."""
    hi = max(KV_CURVE_LENGTHS[-1], info.max_model_len)
    return [[n, kv_bytes_at(info.kv_bytes_per_token, info.layer_windows, info.block_size, n)]
            for n in curve_lengths(info.block_size, hi)]


def _forms(info: ModelInfo) -> list[dict]:
    """MHA / GQA / MQA what-if rows for one replica's pool."""
    pool = info.num_blocks * pool_block_bytes(info)
    return kv_forms(info.num_heads, info.num_kv_heads, info.kv_bytes_per_token, pool, info.block_size,
                    layer_windows=info.layer_windows)


def _replicas_by_node(live: list[MetricsSnapshot]) -> dict[str, list[str]]:
    nodes: dict[str, list[str]] = {}
    for snap in live:
        nodes.setdefault(snap.node, []).append(snap.replica)
    return {node: sorted(ids) for node, ids in sorted(nodes.items())}


def dashboard_data(snapshots: list[MetricsSnapshot], now: float | None = None) -> dict[str, Any]:
    """Per model: static KV facts, live gauges, recent (seq_len, kv_bytes, ttft, itl, e2e) points and
    speculative decoding's counts."""
    now = time.time() if now is None else now
    models = []
    for (model, attention, kv_heads, kv_cache_dtype), snaps in sorted(by_model(snapshots).items()):
        live = fresh(snaps, now)
        info, newest = snaps[0].info, newest_info(snaps)
        recent = sorted((r for s in snaps for r in s.recent), key=lambda r: r.seq_len)[-2000:]
        drafted, accepted = spec_counts(snaps)
        models.append({
            "model": model, "attention": attention, "kv_heads": int(kv_heads), "kv_cache_dtype": kv_cache_dtype,
            "kv_bytes_per_token": info.kv_bytes_per_token, "block_size": info.block_size,
            "max_model_len": info.max_model_len,
            "layer_windows": list(info.layer_windows), "kv_block_bytes": pool_block_bytes(info),
            "attention_variants": list(info.attention_variants),
            "kv_bytes_per_token_at": {str(n): per_token_at(info, n) for n in KV_CURVE_LENGTHS},
            "kv_curve": _curve(info),
            "quantization": newest.quantization, "weight_bytes": newest.weight_bytes,
            "kv_blocks_total": sum(s.gauges.kv_blocks_total for s in live),
            "kv_blocks_used": sum(s.gauges.kv_blocks_used for s in live),
            "requests_running": sum(s.gauges.requests_running for s in live),
            "replicas": len(live),
            # replicas report a "replica" and "node" (Ray ids) next to their counts
            "replicas_by_node": _replicas_by_node(live),
            # the LoRA adapters each live replica holds in a slot now, least recently used first
            "adapters_by_replica": {snap.replica: list(snap.loras) for snap in live},
            # a sharded model's replicas list their ranks (tensor x pipeline parallel workers)
            "tensor_parallel_size": info.tensor_parallel_size,
            "pipeline_parallel_size": info.pipeline_parallel_size,
            "workers": [{**dataclasses.asdict(w), "replica": snap.replica} for snap in live for w in snap.info.workers],
            "forms": _forms(info),
            "speculative": info.speculative,
            # None until a request drafted: the page shows acceptance only where there is some
            "spec_decode": {**spec_totals(drafted, accepted), "drafted_per_pos": drafted,
                            "accepted_per_pos": accepted} if drafted else None,
            "requests": [dataclasses.asdict(r) for r in recent],
        })
    return {"time": now, "models": models}
