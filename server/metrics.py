"""Per-request latency and KV memory against sequence length, per model, summed over replicas.

A `MetricsRecorder` in each replica is fed values only: each finished request's `RequestStats`
and the engine's latest `EngineStats`, both sent by the engine process with its outputs. It turns
them into typed snapshots (server/wire.py `MetricsSnapshot`); snapshots from every replica (pushed to one hub actor in a cluster) are merged and
rendered for Prometheus (server/prometheus.py) and for the built-in dashboard (server/dashboard.py),
which read them with the helpers at the end of this module. No Ray imports: the transport lives in
server/deployment.py.
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Iterable

from models.native.memory import resident_bytes
from server.kv_forms import kv_bytes_per_token_at
from server.wire import (
    EngineStats,
    HistogramCounts,
    MetricsSnapshot,
    ModelInfo,
    ReplicaGauges,
    RequestPoint,
    RequestStats,
)

PREFIX = "attnserve"
MODEL_LABELS = ("model", "attention", "kv_heads", "kv_cache_dtype")
STALE_AFTER_S = 15.0  # gauges of a replica silent for longer are dropped (it is gone)
RECENT_REQUESTS = 500

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def one_two_five(lo: float, hi: float) -> tuple[float, ...]:
    """1-2-5 series from lo up to the first value >= hi."""
    out, decade = [], 1
    while decade * 5 < lo:
        decade *= 10
    while True:
        for m in (1, 2, 5):
            v = m * decade
            if v >= lo:
                out.append(float(v))
            if v >= hi:
                return tuple(out)
        decade *= 10


KV_BYTES_BUCKETS = one_two_five(1e4, 1e11)
GRAMMAR_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
LORA_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def seq_len_bucket(n: int) -> str:
    """'1-1', '2-2', '3-5', '6-10', '11-20', ... : the 1-2-5 range holding n."""
    edges = one_two_five(1, max(n, 1))
    hi = int(edges[-1])
    lo = int(edges[-2]) + 1 if len(edges) > 1 else 1
    return f"{lo}-{hi}"


class _Histogram:
    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(buckets)
        self.series: dict[str, list] = {}  # label value -> [bucket counts..., +Inf count, sum]

    def observe(self, key: str, value: float) -> None:
        s = self.series.setdefault(key, [0] * (len(self.buckets) + 1) + [0.0])
        s[bisect.bisect_left(self.buckets, value)] += 1
        s[-1] += value

    def export(self) -> HistogramCounts:
        return HistogramCounts(self.buckets, {k: list(v) for k, v in self.series.items()})


# name -> (help, buckets, the label its series are keyed by or None)
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time to first token, by prompt+output length", TTFT_BUCKETS, "seq_len_bucket"),
    "inter_token_latency_seconds": ("Gap between consecutive output tokens", ITL_BUCKETS, "seq_len_bucket"),
    "e2e_request_latency_seconds": ("Arrival to last token", LATENCY_BUCKETS, "seq_len_bucket"),
    "request_queue_time_seconds": ("Arrival to first scheduling", LATENCY_BUCKETS, "seq_len_bucket"),
    "request_prefill_time_seconds": ("First scheduling to first token", LATENCY_BUCKETS, "seq_len_bucket"),
    "request_decode_time_seconds": ("First token to last token", LATENCY_BUCKETS, "seq_len_bucket"),
    "request_inference_time_seconds": ("First scheduling to last token", LATENCY_BUCKETS, "seq_len_bucket"),
    "request_time_per_output_token_seconds": ("A request's mean gap between output tokens after the first",
                                              ITL_BUCKETS, "seq_len_bucket"),
    "request_kv_cache_bytes": ("Peak KV-cache bytes held by one request", KV_BYTES_BUCKETS, "seq_len_bucket"),
    "request_kv_blocks": ("Peak KV blocks held by one request", None, "seq_len_bucket"),
    "request_prompt_tokens": ("Prompt tokens per request", None, None),
    "request_generation_tokens": ("Generated tokens per request", None, None),
    "request_max_num_generation_tokens": ("Most tokens one sample of a request generated (once per request)",
                                          None, None),
    "request_params_n": ("Samples asked for per request (n)", N_BUCKETS, None),
    "request_params_max_tokens": ("max_tokens per sample", None, None),
    "grammar_compile_seconds": ("A constrained request's arrival to its grammar ready (compiled, or from the "
                                "cache: cache=hit)", GRAMMAR_BUCKETS, "cache"),
    "lora_load_seconds": ("Time to load a LoRA adapter into a slot (read, check, install)", LORA_LOAD_BUCKETS,
                          None),
}
COUNTERS = {
    "prompt_tokens": "Prompt tokens processed",
    "generation_tokens": "Tokens generated",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits": "Prompt tokens served from the prefix cache",
    "preemptions": "Requests preempted (KV blocks reclaimed, recomputed later)",
    "lora_loads": "LoRA adapters loaded into a slot",
    "lora_evictions": "LoRA adapters gone from a slot (for room, or unloaded)",
}
# finished requests and their tokens by LoRA adapter: MetricsSnapshot's field -> help
LORA_COUNTERS = {
    "lora_requests": "Finished requests by LoRA adapter",
    "lora_prompt_tokens": "Prompt tokens of finished requests by LoRA adapter",
    "lora_generation_tokens": "Tokens generated by LoRA adapter",
}
# speculative decoding, over finished requests (named after vLLM's vllm:spec_decode_*); every total
# follows from the per-position counts, so snapshots carry only those
SPEC_COUNTERS = {
    "num_drafts": "Verification steps that checked drafts (one per request and step)",
    "num_draft_tokens": "Draft tokens proposed",
    "num_accepted_tokens": "Draft tokens accepted",
    "num_emitted_tokens": "Tokens the verification steps emitted (accepted drafts, plus one per step)",
}
SPEC_POS_COUNTERS = {
    "num_draft_tokens_per_pos": "Draft tokens proposed, by position in the draft",
    "num_accepted_tokens_per_pos": "Draft tokens accepted, by position in the draft",
}


def add_positions(acc: list[int], values: Iterable[int]) -> None:
    """acc[i] += values[i], acc grown to fit (a later request may draft further)."""
    for i, v in enumerate(values):
        if i == len(acc):
            acc.append(0)
        acc[i] += v


def spec_totals(drafted: list[int], accepted: list[int]) -> dict[str, int]:
    """SPEC_COUNTERS from per-position counts: a step with k drafts counts at positions 0..k-1 and
    emits its accepted drafts plus one token, so position 0 counts the steps."""
    drafts, num_accepted = (drafted[0] if drafted else 0), sum(accepted)
    return {"num_drafts": drafts, "num_draft_tokens": sum(drafted), "num_accepted_tokens": num_accepted,
            "num_emitted_tokens": num_accepted + drafts}


class MetricsRecorder:
    """Counts for one replica. `on_finished` runs on the engine reader thread, `snapshot` on the
    metrics reporter's."""

    def __init__(self, model: str, info: ModelInfo) -> None:
        self.model, self.info = model, info
        token_buckets = one_two_five(1, info.max_model_len)
        self.histograms = {name: _Histogram(b if b is not None else (one_two_five(1, info.num_blocks) if "blocks" in name
                                                                  else token_buckets))
                           for name, (_, b, _) in HISTOGRAMS.items()}
        self.finish_reasons: dict[str, int] = {}
        self.structured: dict[str, int] = {}  # constrained requests by kind
        self.errors: dict[str, int] = {}
        self.spec_drafted: list[int] = []  # speculative decoding: drafts at position i, summed over requests
        self.spec_accepted: list[int] = []
        self.samples: dict[str, tuple[int, int]] = {}  # an n > 1 request's id -> (samples finished, most tokens)
        self.recent: deque = deque(maxlen=RECENT_REQUESTS)
        self.lora: dict[str, dict[str, int]] = {name: {} for name in LORA_COUNTERS}  # field -> adapter -> count
        self.lock = threading.Lock()

    def on_finished(self, s: RequestStats, finish_reason: str, request_id: str = "") -> None:
        """One sample finished; `request_id` (its request's, shared by the n samples) groups samples."""
        seq_len = s.num_prompt_tokens + s.num_output_tokens
        key = seq_len_bucket(seq_len)
        with self.lock:
            self.finish_reasons[finish_reason] = self.finish_reasons.get(finish_reason, 0) + 1
            if finish_reason == "error":
                self.errors["step_failed"] = self.errors.get("step_failed", 0) + 1
            h = self.histograms
            for name, value in (("time_to_first_token_seconds", s.ttft), ("e2e_request_latency_seconds", s.e2e_latency),
                                ("request_queue_time_seconds", s.queue_time),
                                ("request_prefill_time_seconds", s.prefill_time),
                                ("request_decode_time_seconds", s.decode_time),
                                ("request_inference_time_seconds", s.inference_time),
                                ("request_time_per_output_token_seconds", s.time_per_output_token)):
                if value is not None:
                    h[name].observe(key, value)
            for gap in s.inter_token_latencies:
                h["inter_token_latency_seconds"].observe(key, gap)
            if s.peak_blocks:
                h["request_kv_cache_bytes"].observe(key, s.peak_kv_bytes)
                h["request_kv_blocks"].observe(key, s.peak_blocks)
            if s.structured is not None:
                self.structured[s.structured] = self.structured.get(s.structured, 0) + 1
            if s.grammar_wait_s is not None:
                h["grammar_compile_seconds"].observe("hit" if s.grammar_cache_hit else "miss", s.grammar_wait_s)
            add_positions(self.spec_drafted, s.spec_drafted)
            add_positions(self.spec_accepted, s.spec_accepted)
            h["request_prompt_tokens"].observe("", s.num_prompt_tokens)
            h["request_generation_tokens"].observe("", s.num_output_tokens)
            h["request_params_max_tokens"].observe("", s.max_tokens)
            most = self._last_sample(s, request_id)
            if most is not None:
                h["request_max_num_generation_tokens"].observe("", most)
                h["request_params_n"].observe("", s.n)
            if s.lora is not None:  # a request (and its prompt) once, at its last sample; every sample's tokens
                counts = self.lora
                if most is not None:
                    counts["lora_requests"][s.lora] = counts["lora_requests"].get(s.lora, 0) + 1
                    counts["lora_prompt_tokens"][s.lora] = counts["lora_prompt_tokens"].get(s.lora, 0) + s.num_prompt_tokens
                counts["lora_generation_tokens"][s.lora] = (counts["lora_generation_tokens"].get(s.lora, 0)
                                                            + s.num_output_tokens)
            itl = sum(s.inter_token_latencies) / len(s.inter_token_latencies) if s.inter_token_latencies else None
            self.recent.append(RequestPoint(seq_len, s.num_prompt_tokens, s.num_output_tokens, s.peak_kv_bytes,
                                            s.ttft, itl, s.e2e_latency))

    def _last_sample(self, s: RequestStats, request_id: str) -> int | None:
        """The most tokens any sample of the request generated once its last sample finished, else None
        (as vLLM counts a parallel-sampling request once). Under self.lock."""
        if s.n == 1:
            return s.num_output_tokens
        done, most = self.samples.pop(request_id, (0, 0))
        done, most = done + 1, max(most, s.num_output_tokens)
        if done < s.n:
            self.samples[request_id] = (done, most)
            return None
        return most

    def on_error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def on_lora_load(self, seconds: float) -> None:
        with self.lock:
            self.histograms["lora_load_seconds"].observe("", seconds)

    def snapshot(self, e: EngineStats) -> MetricsSnapshot:
        """Cumulative counts plus current gauges, as values (safe to pickle and merge)."""
        info = self.info
        with self.lock:
            hist = {name: h.export() for name, h in self.histograms.items()}
            counts = dict(finish_reasons=dict(self.finish_reasons), errors=dict(self.errors),
                          structured=dict(self.structured), spec_drafted=tuple(self.spec_drafted),
                          spec_accepted=tuple(self.spec_accepted), recent=tuple(self.recent),
                          **{name: dict(v) for name, v in self.lora.items()})
        bytes_per_block = pool_block_bytes(info)
        gauges = ReplicaGauges(
            kv_blocks_total=info.num_blocks, kv_blocks_used=e.num_used_blocks,
            kv_blocks_cached_free=e.num_cached_free_blocks, kv_bytes_total=info.num_blocks * bytes_per_block,
            kv_bytes_used=e.num_used_blocks * bytes_per_block, requests_running=e.num_running,
            requests_waiting=e.num_waiting, resident_memory_bytes=resident_bytes()[0] + e.resident_memory_bytes)
        counters = {"prompt_tokens": e.num_prompt_tokens, "generation_tokens": e.num_generated_tokens,
                    "prefix_cache_queries": e.num_prefix_queries, "prefix_cache_hits": e.num_prefix_hits,
                    "preemptions": e.num_preemptions, "lora_loads": e.num_lora_loads,
                    "lora_evictions": e.num_lora_evictions}
        by_priority = {str(p): n for p, n in e.preemptions_by_priority.items()}
        return MetricsSnapshot(self.model, info, time.time(), counters, gauges, hist, **counts,
                               preemptions_by_priority=by_priority, loras=e.resident_loras,
                               running_loras=e.running_loras, waiting_loras=e.waiting_loras)


def block_bytes(kv_bytes_per_token: int, block_size: int, kv_block_bytes: int = 0) -> int:
    """Bytes of one pool block: `kv_block_bytes` where known (with sliding-window layers a block id is
    one group's layers, fewer than all), else a block of every layer."""
    return kv_block_bytes or kv_bytes_per_token * block_size


def pool_block_bytes(info: ModelInfo) -> int:
    return block_bytes(info.kv_bytes_per_token, info.block_size, info.kv_block_bytes)


# ---- reading snapshots (server/prometheus.py, server/dashboard.py) ------------------------------
def fresh(snapshots: list[MetricsSnapshot], now: float) -> list[MetricsSnapshot]:
    """Snapshots of replicas still reporting."""
    return [s for s in snapshots if now - s.time <= STALE_AFTER_S]


def spec_counts(snaps: list[MetricsSnapshot]) -> tuple[list[int], list[int]]:
    """Per-position drafted and accepted counts summed over replicas."""
    drafted: list[int] = []
    accepted: list[int] = []
    for s in snaps:
        add_positions(drafted, s.spec_drafted)
        add_positions(accepted, s.spec_accepted)
    accepted += [0] * (len(drafted) - len(accepted))
    return drafted, accepted


def by_model(snapshots: list[MetricsSnapshot]) -> dict[tuple[str, ...], list[MetricsSnapshot]]:
    groups: dict[tuple[str, ...], list[MetricsSnapshot]] = {}
    for s in snapshots:
        groups.setdefault(s.labels, []).append(s)
    return groups


def newest_info(snaps: list[MetricsSnapshot]) -> ModelInfo:
    """The model's facts as its newest report states them (every replica loads the same)."""
    return max(snaps, key=lambda s: s.time).info


def per_token_at(info: ModelInfo, num_tokens: int) -> float:
    return kv_bytes_per_token_at(info.kv_bytes_per_token, info.layer_windows, info.block_size, num_tokens)
