"""Metrics merging and rendering, without Ray: sums across replicas, staleness, exposition format."""
import time
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from models.native.cpu_path import CpuPath
from server.dashboard import dashboard_data
from server.metrics import MetricsRecorder, one_two_five, seq_len_bucket
from server.prometheus import render_prometheus
from server.wire import (
    EngineStats,
    HistogramCounts,
    MetricsSnapshot,
    ModelInfo,
    ReplicaGauges,
    RequestPoint,
    RequestStats,
)

CPU = CpuPath("cpu", "avx2", "bfloat16", "bfloat16", "torch", "sdpa", 1)


def snapshot(model="m", attention="gqa", kv_heads=2, used=3, age=0.0, ttft=(0.1,), finished=1, hits=5, **info_fields):
    """A replica's snapshot as it reaches the hub; `info_fields` replace its ModelInfo's."""
    buckets = (0.05, 0.5, 5.0)
    counts = [0, 0, 0, 0]
    for t in ttft:
        counts[sum(t > b for b in buckets)] += 1
    names = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
             "request_queue_time_seconds", "request_prefill_time_seconds", "request_kv_cache_bytes",
             "request_kv_blocks", "request_prompt_tokens", "request_generation_tokens", "grammar_compile_seconds"]
    hists = {n: HistogramCounts(buckets, {"11-20": counts + [sum(ttft)]} if n == "time_to_first_token_seconds" else {})
             for n in names}
    info = ModelInfo(**{**dict(max_model_len=256, attention=attention, num_kv_heads=kv_heads,
                                kv_bytes_per_token=64 * kv_heads, vocab_size=100, block_size=16, num_blocks=100,
                                num_heads=kv_heads, kv_cache_dtype="bfloat16", cpu_path=CPU, quantization="none",
                                weight_bytes=1000), **info_fields})
    return MetricsSnapshot(
        model, info, time.time() - age,
        counters={"prompt_tokens": 10, "generation_tokens": 7, "prefix_cache_queries": 10, "prefix_cache_hits": hits,
                  "preemptions": 1},
        gauges=ReplicaGauges(kv_blocks_total=100, kv_blocks_used=used, kv_blocks_cached_free=2, kv_bytes_total=1000,
                             kv_bytes_used=used * 10, requests_running=1, requests_waiting=0,
                             resident_memory_bytes=2**20),
        histograms=hists, finish_reasons={"length": finished},
        recent=(RequestPoint(12, 10, 2, 640, 0.1, 0.01, 0.2),))


def parse(text: bytes) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels):
    matches = [v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == v2 for k, v2 in labels.items())]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def test_one_two_five_and_seq_len_buckets():
    assert one_two_five(1, 100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(1e4, 3e4) == (1e4, 2e4, 5e4)
    assert [seq_len_bucket(n) for n in (1, 2, 3, 5, 6, 100, 101, 4096)] == \
        ["1-1", "2-2", "3-5", "3-5", "6-10", "51-100", "101-200", "2001-5000"]


def test_replicas_are_summed_and_stale_gauges_dropped():
    snaps = [snapshot(used=3, ttft=(0.1, 1.0)), snapshot(used=4, ttft=(0.01,)), snapshot(used=50, age=60, ttft=(9.0,))]
    s = parse(render_prometheus(snaps))
    assert value(s, "attnserve_kv_blocks", model="m", state="used") == 7  # the stale replica's gauge is gone
    assert value(s, "attnserve_replicas", model="m") == 2
    assert value(s, "attnserve_prefix_cache_hits_total", model="m") == 15  # ...but its counts stay
    assert value(s, "attnserve_time_to_first_token_seconds_count", model="m", seq_len_bucket="11-20") == 4
    assert value(s, "attnserve_time_to_first_token_seconds_bucket", model="m", le="0.5") == 2
    assert value(s, "attnserve_kv_bytes_per_token", model="m", attention="gqa", kv_heads="2") == 128
    assert value(s, "attnserve_requests_total", model="m", finish_reason="length") == 3


def test_models_stay_apart():
    s = parse(render_prometheus([snapshot("a", "mha", 4), snapshot("b", "mqa", 1)]))
    assert value(s, "attnserve_kv_bytes_per_token", model="a") == 4 * value(s, "attnserve_kv_bytes_per_token", model="b")
    data = dashboard_data([snapshot("a", "mha", 4), snapshot("b", "mqa", 1)])
    assert [m["model"] for m in data["models"]] == ["a", "b"] and data["models"][0]["requests"][0]["kv_bytes"] == 640


def test_every_model_gets_its_mha_gqa_mqa_forms():
    from server.kv_forms import kv_forms

    rows = kv_forms(num_heads=9, num_kv_heads=3, kv_bytes_per_token=23040, pool_bytes=2**30, block_size=16)
    assert [(r["attention"], r["kv_heads"], r["kv_bytes_per_token"], r["what_if"]) for r in rows] == [
        ("mha", 9, 69120, True), ("gqa", 3, 23040, False), ("mqa", 1, 7680, True)]
    assert [r["admitted_requests"] for r in rows] == [2**30 // (b * 16) // 64 for b in (69120, 23040, 7680)]
    mha = kv_forms(num_heads=12, num_kv_heads=12, kv_bytes_per_token=1200, pool_bytes=2**20, block_size=16)
    assert [(r["attention"], r["kv_heads"], r["what_if"]) for r in mha] == [
        ("mha", 12, False), ("gqa", 6, True), ("mqa", 1, True)]
    snap = snapshot("a", "gqa", 2, num_heads=4, num_blocks=10)
    (model,) = dashboard_data([snap])["models"]
    assert [f["kv_heads"] for f in model["forms"]] == [4, 2, 1]


def test_eval_rows_merge_in_the_cache(tmp_path, monkeypatch):
    from server import eval_results

    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path))
    assert eval_results.load() == []
    row = {"model": "m", "attention": "gqa", "kv_heads": 2, "kv_cache_dtype": "bfloat16",
           "kv_bytes_per_token": 8, "perplexity": 3.0}
    eval_results.save([row, {**row, "model": "n"}])
    eval_results.save([{**row, "perplexity": 2.5}])  # the same model and KV dtype again: replaced
    assert sorted((r["model"], r["perplexity"]) for r in eval_results.load()) == [("m", 2.5), ("n", 3.0)]
    assert eval_results.results_path().parent == tmp_path / "eval"


def test_weight_bytes_gauge_and_dashboard_fields(promtool):
    a, b = (snapshot("a", "gqa", 2, age=age, quantization="int8", weight_bytes=123_456) for age in (0.0, 1.0))
    s = parse(render_prometheus([a, b, snapshot("plain", "mqa", 1)]))  # "plain": unquantized, 1000 bytes
    assert value(s, "attnserve_model_weight_bytes", model="a", quantization="int8", kv_heads="2") == 123_456  # not summed
    assert value(s, "attnserve_model_weight_bytes", model="plain", quantization="none") == 1000
    assert len([k for k in s if k[0] == "attnserve_model_weight_bytes"]) == 2  # one per model, whatever its replicas
    data = {m["model"]: m for m in dashboard_data([a, b, snapshot("plain", "mqa", 1)])["models"]}
    assert (data["a"]["quantization"], data["a"]["weight_bytes"]) == ("int8", 123_456)
    assert (data["plain"]["quantization"], data["plain"]["weight_bytes"]) == ("none", 1000)
    assert promtool(render_prometheus([a, b])) == []


def test_eval_rows_merge_per_weight_format(tmp_path, monkeypatch):
    from server import eval_results

    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path))
    old = {"model": "m", "attention": "gqa", "kv_heads": 2, "kv_cache_dtype": "bfloat16", "kv_bytes_per_token": 8,
           "perplexity": 3.0}  # written before rows had a weight format: its weights were served dequantized
    eval_results.save([old])
    new = {**old, "quantization": "none", "weight_bytes": 1000, "perplexity": 2.9}
    eval_results.save([new, {**new, "quantization": "int8", "weight_bytes": 300, "perplexity": 3.1}])
    assert sorted((r["quantization"], r["perplexity"]) for r in eval_results.load()) == [("int8", 3.1), ("none", 2.9)]


def test_dashboard_lists_replicas_per_node():
    snaps = [replace(snapshot("a", "gqa", 2), replica=r, node=n) for r, n in (("r2", "nB"), ("r1", "nA"), ("r3", "nA"))]
    (model,) = dashboard_data(snaps)["models"]
    assert model["replicas_by_node"] == {"nA": ["r1", "r3"], "nB": ["r2"]} and model["replicas"] == 3


def test_promtool_accepts_the_exposition(promtool):
    text = render_prometheus([snapshot(), snapshot("b", "mha", 4)])
    assert promtool(text) == []


def recorder_snapshot(*spec: tuple[list[int], list[int]], speculative="ngram") -> MetricsSnapshot:
    """A real recorder's snapshot after finished requests with these (drafted, accepted) per position."""
    info = ModelInfo(256, "gqa", 2, 128, 100, 16, 100, 4, "bfloat16", CPU, "none", 1000, speculative)
    rec = MetricsRecorder("m", info)
    for drafted, accepted in spec:
        rec.on_finished(RequestStats(0.0, 5, first_token_time=0.1, finished_time=0.2, num_output_tokens=8,
                                     spec_drafted=drafted, spec_accepted=accepted), "length")
    return rec.snapshot(EngineStats(time.time(), 0, 0, 100, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))


def test_spec_decode_counters_sum_requests_and_replicas(promtool):
    # request a: steps of 2 and 1 drafts, 1 then 0 accepted; b: 3, 3 and 2 drafts, 3, 2 and 1 accepted
    a, b = ([2, 1], [1, 0]), ([3, 3, 2], [3, 2, 1])
    one, two = recorder_snapshot(a, b, ([], [])), recorder_snapshot(a)
    s = parse(render_prometheus([one]))
    totals = {n: value(s, f"attnserve_spec_decode_{n}_total", model="m") for n in
              ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")}
    assert totals == {"num_drafts": 5, "num_draft_tokens": 11, "num_accepted_tokens": 7, "num_emitted_tokens": 12}
    s = parse(render_prometheus([one, two]))
    totals = {n: value(s, f"attnserve_spec_decode_{n}_total", model="m") for n in totals}
    assert totals == {"num_drafts": 7, "num_draft_tokens": 14, "num_accepted_tokens": 8, "num_emitted_tokens": 15}
    for name, expected in (("num_draft_tokens_per_pos", [7, 5, 2]), ("num_accepted_tokens_per_pos", [5, 2, 1])):
        assert [value(s, f"attnserve_spec_decode_{name}_total", position=str(i)) for i in range(3)] == expected
        assert not [k for k in s if k[0] == f"attnserve_spec_decode_{name}_total" and dict(k[1])["position"] == "3"]
    (model,) = dashboard_data([one, two])["models"]
    assert model["speculative"] == "ngram"
    assert model["spec_decode"] == {"num_drafts": 7, "num_draft_tokens": 14, "num_accepted_tokens": 8,
                                    "num_emitted_tokens": 15, "drafted_per_pos": [7, 5, 2], "accepted_per_pos": [5, 2, 1]}
    assert promtool(render_prometheus([one, two])) == []


def test_spec_decode_counters_are_zero_without_speculation():
    plain, old = recorder_snapshot(([], []), speculative=None), snapshot("old")  # old: from before speculation
    text = render_prometheus([plain, old])
    assert b"# TYPE attnserve_spec_decode_num_drafts_total counter" in text
    assert b"# HELP attnserve_spec_decode_num_accepted_tokens_per_pos_total" in text
    s = parse(text)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"):
        assert value(s, f"attnserve_spec_decode_{name}_total", model="m") == 0
        assert value(s, f"attnserve_spec_decode_{name}_total", model="old") == 0
    assert not [k for k in s if "_per_pos" in k[0]]
    assert [(m["speculative"], m["spec_decode"]) for m in dashboard_data([plain, old])["models"]] == [(None, None)] * 2


def test_the_hub_keeps_a_replicas_newer_snapshot_whatever_order_its_reports_run_in():
    """The AppState actor runs calls out of order (server/deployment.py): an older report arriving second
    must not take a replica's counters back."""
    from server.deployment import MetricsHub

    hub = MetricsHub()
    old, new = snapshot(age=2.0, hits=5), snapshot(hits=9)
    hub.report("r1", new)
    hub.report("r1", old)
    hub.report("r2", old)
    assert hub.collect() == [new, old]
