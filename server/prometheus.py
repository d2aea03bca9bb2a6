"""Prometheus text exposition of the replicas' metrics snapshots (server/metrics.py), merged per model."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from server.kv_forms import KV_CURVE_LENGTHS
from server.metrics import (
    COUNTERS,
    HISTOGRAMS,
    LORA_COUNTERS,
    MODEL_LABELS,
    PREFIX,
    SPEC_COUNTERS,
    SPEC_POS_COUNTERS,
    by_model,
    fresh,
    newest_info,
    per_token_at,
    spec_counts,
    spec_totals,
)
from server.vllm_metrics import vllm_families
from server.wire import MetricsSnapshot

_LABELS = list(MODEL_LABELS)


def _family(kind, name: str, help_: str, *extra: str):
    """A metric family of `kind` (gauge, counter, histogram) labelled by model and `extra`."""
    return kind(f"{PREFIX}_{name}", help_, labels=_LABELS + list(extra))


def _gauge_families() -> dict[str, GaugeMetricFamily]:
    def gauge(name: str, help_: str, *extra: str) -> GaugeMetricFamily:
        return _family(GaugeMetricFamily, name, help_, *extra)

    return {
        "kv_blocks": gauge("kv_blocks", "KV blocks by state (summed over live replicas)", "state"),
        "kv_bytes": gauge("kv_bytes", "KV-cache bytes by state (summed over live replicas)", "state"),
        "kv_bytes_per_token": gauge("kv_bytes_per_token", "2 x layers x kv_heads x head_dim x KV dtype bytes"),
        # with sliding-window layers per-token bytes fall with length (a windowed layer keeps
        # at most its window + one block); without, this equals kv_bytes_per_token at every length
        "kv_bytes_per_token_at_length": gauge(
            "kv_bytes_per_token_at_length",
            "KV bytes the pool holds for one sequence of `tokens` tokens, per token (block granular)", "tokens"),
        "kv_cache_usage_ratio": gauge("kv_cache_usage_ratio", "Used / total KV blocks"),
        "requests_running": gauge("requests_running", "Requests being decoded or prefilled"),
        "requests_waiting": gauge("requests_waiting", "Requests queued for admission"),
        "replicas": gauge("replicas", "Live replicas reporting"),
        "memory": gauge("replica_resident_memory_bytes", "Resident memory of the model replicas (summed)"),
        # per replica, not summed: what one engine's weights take as served, next to its KV pool
        "weight_bytes": gauge("model_weight_bytes", "Bytes one replica's weights take as served (quantization: "
                              "their format)", "quantization"),
        "lora_resident": gauge("lora_adapter_replicas", "Live replicas holding the LoRA adapter in a slot now",
                               "adapter"),
    }


def _counter_families() -> dict[str, CounterMetricFamily]:
    def counter(name: str, help_: str, *extra: str) -> CounterMetricFamily:
        return _family(CounterMetricFamily, name, help_, *extra)

    return {
        **{name: counter(name, help_) for name, help_ in COUNTERS.items()},
        "finish_reasons": counter("requests", "Finished requests by reason", "finish_reason"),
        "errors": counter("request_errors", "Failed or rejected requests by error type", "error_type"),
        "structured": counter("structured_requests", "Finished constrained requests by kind (json, json_object, "
                              "regex, choice, grammar, tool_call)", "kind"),
        "preemptions_by_priority": counter("preemptions_by_priority", "Requests preempted, by their priority "
                                           "(--scheduling-policy priority; fcfs: all 0)", "priority"),
        **{name: counter(f"spec_decode_{name}", help_) for name, help_ in SPEC_COUNTERS.items()},
        **{name: counter(f"spec_decode_{name}", help_, "position") for name, help_ in SPEC_POS_COUNTERS.items()},
        **{name: counter(name, help_, "adapter") for name, help_ in LORA_COUNTERS.items()},
    }


def _add_gauges(g: dict[str, GaugeMetricFamily], lv: list[str], snaps: list[MetricsSnapshot],
                live: list[MetricsSnapshot]) -> None:
    def gs(k: str) -> float:
        return sum(getattr(s.gauges, k) for s in live)

    for state, k in (("total", "kv_blocks_total"), ("used", "kv_blocks_used"), ("cached_free", "kv_blocks_cached_free")):
        g["kv_blocks"].add_metric(lv + [state], gs(k))
    for state, k in (("capacity", "kv_bytes_total"), ("used", "kv_bytes_used")):
        g["kv_bytes"].add_metric(lv + [state], gs(k))
    g["kv_bytes_per_token"].add_metric(lv, max(s.info.kv_bytes_per_token for s in snaps))
    info = newest_info(snaps)
    for n in KV_CURVE_LENGTHS:
        g["kv_bytes_per_token_at_length"].add_metric(lv + [str(n)], per_token_at(info, n))
    total = gs("kv_blocks_total")
    g["kv_cache_usage_ratio"].add_metric(lv, gs("kv_blocks_used") / total if total else 0.0)
    g["requests_running"].add_metric(lv, gs("requests_running"))
    g["requests_waiting"].add_metric(lv, gs("requests_waiting"))
    g["replicas"].add_metric(lv, len(live))
    g["memory"].add_metric(lv, gs("resident_memory_bytes"))
    g["weight_bytes"].add_metric(lv + [info.quantization], info.weight_bytes)
    held: dict[str, int] = {}
    for s in live:
        for name in s.loras:
            held[name] = held.get(name, 0) + 1
    for name, n in sorted(held.items()):
        g["lora_resident"].add_metric(lv + [name], n)


def _add_counters(c: dict[str, CounterMetricFamily], lv: list[str], snaps: list[MetricsSnapshot]) -> None:
    for name in COUNTERS:  # NOTE: a snapshot from an older replica may lack a newer counter: it counts 0
        c[name].add_metric(lv, sum(s.counters.get(name, 0) for s in snaps))
    for field in ("finish_reasons", "errors", "structured", "preemptions_by_priority", *LORA_COUNTERS):
        merged: dict[str, int] = {}
        for s in snaps:
            for k, v in getattr(s, field).items():
                merged[k] = merged.get(k, 0) + v
        for k, v in sorted(merged.items()):
            c[field].add_metric(lv + [k], v)
    drafted, accepted = spec_counts(snaps)
    for name, v in spec_totals(drafted, accepted).items():
        c[name].add_metric(lv, v)
    for i, (d, a) in enumerate(zip(drafted, accepted)):
        c["num_draft_tokens_per_pos"].add_metric(lv + [str(i)], d)
        c["num_accepted_tokens_per_pos"].add_metric(lv + [str(i)], a)


def _add_histograms(h: dict[str, HistogramMetricFamily], lv: list[str], snaps: list[MetricsSnapshot]) -> None:
    for name, fam in h.items():
        # NOTE: a snapshot from an older replica may lack a newer histogram: it counts none there
        have = [s.histograms[name] for s in snaps if name in s.histograms]
        if not have:
            continue
        buckets = have[0].buckets
        merged: dict[str, list] = {}
        for counts in have:
            for k, v in counts.series.items():
                acc = merged.setdefault(k, [0] * len(v))
                for i, x in enumerate(v):
                    acc[i] += x
        for k, v in sorted(merged.items(), key=lambda kv: _bucket_order(kv[0])):
            cumulative, pairs = 0, []
            for edge, count in zip([*buckets, float("inf")], v[:-1]):
                cumulative += count
                pairs.append(("+Inf" if edge == float("inf") else _edge(edge), cumulative))
            fam.add_metric(lv + ([k] if HISTOGRAMS[name][2] else []), pairs, v[-1])


class _SnapshotCollector:
    def __init__(self, snapshots: list[MetricsSnapshot], now: float) -> None:
        self.snapshots, self.now = snapshots, now

    def collect(self):
        gauges, counters = _gauge_families(), _counter_families()
        hists = {name: _family(HistogramMetricFamily, name, help_, *([label] if label else []))
                 for name, (help_, _, label) in HISTOGRAMS.items()}
        for key, snaps in by_model(self.snapshots).items():
            _add_gauges(gauges, list(key), snaps, fresh(snaps, self.now))
            _add_counters(counters, list(key), snaps)
            _add_histograms(hists, list(key), snaps)
        yield from gauges.values()
        yield from counters.values()
        yield from hists.values()
        yield from vllm_families(self.snapshots, self.now)


def _edge(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)


def _bucket_order(label: str) -> int:
    return int(label.split("-")[0]) if label and label[0].isdigit() else 0


def render_prometheus(snapshots: list[MetricsSnapshot], now: float | None = None) -> bytes:
    """Prometheus text exposition of the merged snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshots, time.time() if now is None else now))
    return generate_latest(registry)
