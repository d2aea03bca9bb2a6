"""vLLM's metric names (`vllm:*`) beside ours, from the same merged snapshots: a Grafana dashboard or
an alert written for vLLM reads attnserve unchanged.

Names, kinds, help texts and buckets are vLLM v1's (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
Every series is labelled `model_name` (the served name) and sums the model's replicas, as ours do
(vLLM adds `engine`, one series per engine core of one server; a replica here is no such thing). The
histograms are ours (server/metrics.py HISTOGRAMS) summed over their `seq_len_bucket`s and read at
vLLM's bucket edges, each of which is one of our edges, so the counts are exact. deploy/README.md
lists the aliases.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from server.metrics import N_BUCKETS, TTFT_BUCKETS, fresh, newest_info, one_two_five
from server.wire import HistogramCounts, MetricsSnapshot

PREFIX = "vllm"
LABELS = ["model_name"]
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason: each shown from the start

GAUGES = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    # vLLM < 0.10's name of kv_cache_usage_perc, which older dashboards read
    "gpu_cache_usage_perc": "GPU KV-cache usage. 1 means 100 percent usage."
                            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
}
COUNTERS = {  # vLLM's name -> (its help, our counter: server/metrics.py COUNTERS)
    "num_preemptions": ("Cumulative number of preemption from the engine.", "preemptions"),
    "prompt_tokens": ("Number of prefill tokens processed.", "prompt_tokens"),
    "generation_tokens": ("Number of generation tokens processed.", "generation_tokens"),
    "prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
    "prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
}
# vLLM's name -> (its help, our histogram it reads, vLLM's buckets; None: 1-2-5 up to the model's context)
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Histogram of time to first token in seconds.", "time_to_first_token_seconds",
                                    TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", "inter_token_latency_seconds",
                                    ITL_BUCKETS),
    # vLLM < 0.11's name of inter_token_latency_seconds, which older dashboards read
    "time_per_output_token_seconds": ("Histogram of time per output token in seconds."
                                      "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                                      "inter_token_latency_seconds", ITL_BUCKETS),
    "request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                              "request_time_per_output_token_seconds", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", "e2e_request_latency_seconds",
                                    REQUEST_LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                   "request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
    "request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.",
                                       "request_inference_time_seconds", REQUEST_LATENCY_BUCKETS),
    "request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                     "request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS),
    "request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                    "request_decode_time_seconds", REQUEST_LATENCY_BUCKETS),
    "request_prompt_tokens": ("Number of prefill tokens processed.", "request_prompt_tokens", None),
    "request_generation_tokens": ("Number of generation tokens processed.", "request_generation_tokens", None),
    "request_max_num_generation_tokens": ("Histogram of maximum number of requested generation tokens.",
                                          "request_max_num_generation_tokens", None),
    "request_params_n": ("Histogram of the n request parameter.", "request_params_n", N_BUCKETS),
    "request_params_max_tokens": ("Histogram of the max_tokens request parameter.", "request_params_max_tokens", None),
}


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, ... up to max_model_len (ours go one edge past it)."""
    return tuple(b for b in one_two_five(1, max_model_len) if b <= max_model_len)


def at_edges(have: list[HistogramCounts], edges: tuple[float, ...]) -> tuple[list[tuple[str, float]], float]:
    """Our counts (every replica and label value) cumulative at `edges`, then +Inf, and the sum: at
    an edge, what our buckets up to it hold. NOTE: exact where each edge is one of ours, as the
    recorder's are (tests/test_vllm_metrics.py); else an observation counts at the next edge past its bucket."""
    counts, total = [0] * (len(edges) + 1), 0.0
    for h in have:
        upto = [bisect.bisect_right(h.buckets, e) for e in edges]  # our buckets <= each edge
        for v in h.series.values():  # [count per bucket..., +Inf count, sum]
            cumulative = [0, *accumulate(v[:-1])]
            for j, n in enumerate(upto):
                counts[j] += cumulative[n]
            counts[-1] += cumulative[-1]
            total += v[-1]
    return [(floatToGoString(e), c) for e, c in zip(edges, counts)] + [("+Inf", counts[-1])], total


def _by_name(snapshots: list[MetricsSnapshot]) -> dict[str, list[MetricsSnapshot]]:
    groups: dict[str, list[MetricsSnapshot]] = {}
    for s in snapshots:
        groups.setdefault(s.model, []).append(s)
    return groups


def vllm_families(snapshots: list[MetricsSnapshot], now: float) -> Iterator[Metric]:
    """The `vllm:*` families of the snapshots, one series per served model."""
    gauges = {name: GaugeMetricFamily(f"{PREFIX}:{name}", help_, labels=LABELS) for name, help_ in GAUGES.items()}
    counters = {name: CounterMetricFamily(f"{PREFIX}:{name}", help_, labels=LABELS)
                for name, (help_, _) in COUNTERS.items()}
    success = CounterMetricFamily(f"{PREFIX}:request_success", "Count of successfully processed requests.",
                                  labels=[*LABELS, "finished_reason"])
    hists = {name: HistogramMetricFamily(f"{PREFIX}:{name}", help_, labels=LABELS)
             for name, (help_, _, _) in HISTOGRAMS.items()}
    for model, snaps in sorted(_by_name(snapshots).items()):
        live = fresh(snaps, now)
        total = sum(s.gauges.kv_blocks_total for s in live)
        usage = sum(s.gauges.kv_blocks_used for s in live) / total if total else 0.0
        for name, v in (("num_requests_running", sum(s.gauges.requests_running for s in live)),
                        ("num_requests_waiting", sum(s.gauges.requests_waiting for s in live)),
                        ("kv_cache_usage_perc", usage), ("gpu_cache_usage_perc", usage)):
            gauges[name].add_metric([model], v)
        for name, (_, ours) in COUNTERS.items():
            counters[name].add_metric([model], sum(s.counters.get(ours, 0) for s in snaps))
        reasons = dict.fromkeys(FINISH_REASONS, 0)
        for s in snaps:
            for reason, n in s.finish_reasons.items():
                reasons[reason] = reasons.get(reason, 0) + n
        for reason, n in reasons.items():
            success.add_metric([model, reason], n)
        max_model_len = newest_info(snaps).max_model_len
        for name, (_, ours, edges) in HISTOGRAMS.items():
            have = [s.histograms[ours] for s in snaps if ours in s.histograms]
            buckets, total_sum = at_edges(have, edges if edges is not None else token_buckets(max_model_len))
            hists[name].add_metric([model], buckets, total_sum)
    yield from gauges.values()
    yield from counters.values()
    yield success
    yield from lora_requests_info(fresh(snapshots, now))
    yield from hists.values()


def lora_requests_info(live: list[MetricsSnapshot]) -> Iterator[Metric]:
    """vLLM's info gauge, unlabelled by model as vLLM's is (one series for the server): the adapters of
    running and waiting requests in its labels (comma-joined), its value the report's time. Only with
    LoRA slots (--max-loras)."""
    with_lora = [s for s in live if s.info.lora is not None]
    if not with_lora:
        return
    family = GaugeMetricFamily(f"{PREFIX}:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    running = sorted({a for s in with_lora for a in s.running_loras})
    waiting = sorted({a for s in with_lora for a in s.waiting_loras})
    family.add_metric([str(max(s.info.lora.max_loras for s in with_lora)), ",".join(waiting), ",".join(running)],
                      max(s.time for s in with_lora))
    yield family
