"""vLLM's metric names beside ours (server/vllm_metrics.py): kinds, labels and buckets equal vLLM's,
values equal ours and follow the requests, and every panel query of vLLM's example Grafana dashboard
(deploy/grafana/vllm.json, vendored verbatim) returns data from a real Prometheus scraping a real
Ray Serve app after completions and chat traffic."""
import json
import math
import re
import subprocess
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from loadtests.servers import free_port
from models.native.cpu_path import CpuPath
from server.metrics import MetricsRecorder
from server.prometheus import render_prometheus
from server.vllm_metrics import HISTOGRAMS
from server.wire import EngineStats, ModelInfo, RequestStats

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "vllm.json"
CPU = CpuPath("cpu", "avx2", "bfloat16", "bfloat16", "torch", "sdpa", 1)

# vLLM v1's families as its PrometheusStatLogger declares them (vllm/v1/metrics/loggers.py), written
# out from its source: kind, and a histogram's buckets (TOKENS: build_1_2_5_buckets(max_model_len))
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TOKENS = "build_1_2_5_buckets(max_model_len)"
VLLM = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:gpu_cache_usage_perc": ("gauge", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:request_success": ("counter", None),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", ITL),
    "vllm:time_per_output_token_seconds": ("histogram", ITL),
    "vllm:request_time_per_output_token_seconds": ("histogram", ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", LATENCY),
    "vllm:request_inference_time_seconds": ("histogram", LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", LATENCY),
    "vllm:request_prompt_tokens": ("histogram", TOKENS),
    "vllm:request_generation_tokens": ("histogram", TOKENS),
    "vllm:request_max_num_generation_tokens": ("histogram", TOKENS),
    "vllm:request_params_max_tokens": ("histogram", TOKENS),
    "vllm:request_params_n": ("histogram", [1, 2, 5, 10, 20]),
}
FINISH_REASONS = {"stop", "length", "abort", "error", "repetition"}  # vLLM's FinishReason, all shown from the start


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's, as written there: 1, 2, 5, 10, ... while <= max_value."""
    exponent, buckets = 0, []
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def check_kinds_labels_and_buckets(text: str, model: str, max_model_len: int) -> None:
    fams = {name: f for name, f in families(text).items() if name.startswith("vllm:")}
    assert set(fams) == set(VLLM)
    for name, (kind, buckets) in VLLM.items():
        f = fams[name]
        assert f.type == kind, name
        mine = [s for s in f.samples if s.labels["model_name"] == model]
        labels = {k for s in mine for k in s.labels} - {"le"}
        assert labels == ({"model_name", "finished_reason"} if name == "vllm:request_success" else {"model_name"})
        if kind == "histogram":
            edges = build_1_2_5_buckets(max_model_len) if buckets == TOKENS else buckets
            les = [s.labels["le"] for s in mine if s.name == f"{name}_bucket"]
            assert les == [floatToGoString(e) for e in edges] + ["+Inf"], name
    success = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples
               if s.labels["model_name"] == model}
    assert success >= FINISH_REASONS


def sample_values(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def info(max_model_len: int = 256, num_blocks: int = 100) -> ModelInfo:
    return ModelInfo(max_model_len=max_model_len, attention="gqa", num_kv_heads=2, kv_bytes_per_token=128,
                     vocab_size=100, block_size=16, num_blocks=num_blocks, num_heads=4, kv_cache_dtype="bfloat16",
                     cpu_path=CPU, quantization="none", weight_bytes=1000)


def engine_stats(used: int, running: int = 1, waiting: int = 2) -> EngineStats:
    return EngineStats(time=time.time(), num_running=running, num_waiting=waiting, num_blocks=100,
                       num_used_blocks=used, num_cached_free_blocks=0, num_unfinished_groups=0, num_prompt_tokens=40,
                       num_generated_tokens=14, num_prefix_queries=40, num_prefix_hits=16, num_preemptions=3,
                       num_steps=9, num_step_errors=0, num_adds_received=3, resident_memory_bytes=0)


def stats(num_output_tokens: int, n: int = 1, max_tokens: int = 16, prompt: int = 5) -> RequestStats:
    """A finished sample; its times are binary fractions, so every interval is exact."""
    return RequestStats(0.0, prompt, first_scheduled_time=0.125, first_token_time=0.375, last_token_time=0.875,
                        finished_time=1.0, num_output_tokens=num_output_tokens,
                        inter_token_latencies=[0.5 / (num_output_tokens - 1)] * (num_output_tokens - 1),
                        n=n, max_tokens=max_tokens)


def recorded(max_model_len: int = 256) -> MetricsRecorder:
    """One n=1 request that stopped (3 tokens) and one n=2 request whose samples ran to length (4 and 7)."""
    rec = MetricsRecorder("m", info(max_model_len))
    rec.on_finished(stats(3), "stop", "a")
    rec.on_finished(stats(7, n=2, max_tokens=8), "length", "b")
    rec.on_finished(stats(4, n=2, max_tokens=8), "length", "b")
    return rec


@pytest.mark.parametrize("max_model_len", [256, 500, 2048])
def test_kinds_labels_and_buckets_are_vllms(max_model_len, promtool):
    text = render_prometheus([recorded(max_model_len).snapshot(engine_stats(used=10))]).decode()
    check_kinds_labels_and_buckets(text, "m", max_model_len)
    assert promtool(text.encode()) == []


@pytest.mark.parametrize("max_model_len", [256, 500, 2048, 131072])
def test_each_vllm_edge_is_one_of_ours(max_model_len):
    """So each vLLM bucket is our counts up to it: exact, not interpolated."""
    rec = MetricsRecorder("m", info(max_model_len))
    for name, (_, ours, _) in HISTOGRAMS.items():
        buckets = VLLM[f"vllm:{name}"][1]
        edges = build_1_2_5_buckets(max_model_len) if buckets == TOKENS else buckets
        assert set(edges) <= set(rec.histograms[ours].buckets), name


def test_values_follow_the_requests():
    s = sample_values(render_prometheus([recorded().snapshot(engine_stats(used=10))]).decode())
    reasons = {r: value(s, "vllm:request_success_total", model_name="m", finished_reason=r) for r in FINISH_REASONS}
    assert reasons == {"stop": 1, "length": 2, "abort": 0, "error": 0, "repetition": 0}
    # per sample: 3 of them; intervals from stats(): ttft 0.375, queue 0.125, prefill 0.25, decode 0.5,
    # inference 0.75, e2e 1.0, per-request TPOT 0.5 / (tokens - 1)
    per_sample = {"time_to_first_token_seconds": [0.375] * 3, "request_queue_time_seconds": [0.125] * 3,
                  "request_prefill_time_seconds": [0.25] * 3, "request_decode_time_seconds": [0.5] * 3,
                  "request_inference_time_seconds": [0.75] * 3, "e2e_request_latency_seconds": [1.0] * 3,
                  "request_time_per_output_token_seconds": [0.25, 0.5 / 6, 0.5 / 3],
                  "inter_token_latency_seconds": [0.25] * 2 + [0.5 / 6] * 6 + [0.5 / 3] * 3,
                  "request_prompt_tokens": [5] * 3, "request_generation_tokens": [3, 7, 4],
                  "request_params_max_tokens": [16, 8, 8],
                  # per request, once its last sample finished
                  "request_max_num_generation_tokens": [3, 7], "request_params_n": [1, 2]}
    per_sample["time_per_output_token_seconds"] = per_sample["inter_token_latency_seconds"]
    for name, observed in per_sample.items():
        buckets = VLLM[f"vllm:{name}"][1]
        edges = build_1_2_5_buckets(256) if buckets == TOKENS else buckets
        got = [value(s, f"vllm:{name}_bucket", model_name="m", le=floatToGoString(e)) for e in edges]
        assert got == [sum(v <= e for v in observed) for e in edges], name
        assert value(s, f"vllm:{name}_count", model_name="m") == len(observed)
        assert value(s, f"vllm:{name}_sum", model_name="m") == pytest.approx(sum(observed))
    for ours, theirs in (("prompt_tokens", "prompt_tokens"), ("generation_tokens", "generation_tokens"),
                         ("prefix_cache_queries", "prefix_cache_queries"), ("prefix_cache_hits", "prefix_cache_hits"),
                         ("preemptions", "num_preemptions")):
        assert value(s, f"vllm:{theirs}_total", model_name="m") == value(s, f"attnserve_{ours}_total", model="m") > 0
    assert value(s, "vllm:num_requests_running", model_name="m") == 1
    assert value(s, "vllm:num_requests_waiting", model_name="m") == 2
    assert value(s, "vllm:kv_cache_usage_perc", model_name="m") == value(s, "vllm:gpu_cache_usage_perc",
                                                                         model_name="m") == 0.1


def test_replicas_sum_and_models_stay_apart():
    one, two = recorded().snapshot(engine_stats(used=10)), recorded().snapshot(engine_stats(used=30, running=2))
    other = MetricsRecorder("other", info()).snapshot(engine_stats(used=0, running=0, waiting=0))
    s = sample_values(render_prometheus([one, two, other]).decode())
    assert value(s, "vllm:kv_cache_usage_perc", model_name="m") == 0.2  # (10 + 30) / (100 + 100)
    assert value(s, "vllm:num_requests_running", model_name="m") == 3
    assert value(s, "vllm:e2e_request_latency_seconds_count", model_name="m") == 6
    assert value(s, "vllm:request_success_total", model_name="m", finished_reason="length") == 4
    assert value(s, "vllm:prompt_tokens_total", model_name="m") == 80
    # a model without requests: its series are there, at zero, as vLLM's are from the start
    assert value(s, "vllm:e2e_request_latency_seconds_count", model_name="other") == 0
    assert value(s, "vllm:request_success_total", model_name="other") == 0
    assert value(s, "vllm:kv_cache_usage_perc", model_name="other") == 0
    # our histograms, summed over seq_len_bucket, equal vLLM's at every edge the two share
    for name, (_, ours, _) in HISTOGRAMS.items():
        for (n, ls), v in s.items():
            labels = dict(ls)
            if n == f"vllm:{name}_bucket" and labels["model_name"] == "m" and labels["le"] != "+Inf":
                edge = float(labels["le"])
                mine = sum(x for (n2, ls2), x in s.items() if n2 == f"attnserve_{ours}_bucket"
                           and dict(ls2)["model"] == "m" and dict(ls2)["le"] != "+Inf"
                           and float(dict(ls2)["le"]) == edge)
                assert v == mine, (name, edge)


# ---- a real Prometheus scraping a real Serve app, and vLLM's dashboard's queries -------------------
MODEL = "tiny-gqa"  # two replicas: the series sum them
WINDOW = "5m"  # $__rate_interval: the whole of this module's Prometheus


@contextmanager
def running_prometheus(prometheus: str, target: str, tmp_path: Path):
    """A Prometheus scraping `target` every second (deploy/prometheus/prometheus.yml); yields its URL."""
    port = free_port()
    cfg = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(cfg.replace("scrape_interval: 5s", "scrape_interval: 1s")
                                             .replace("127.0.0.1:8000", target))
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class NotReady(Exception):
    """Prometheus answers 503 until its storage has started (seconds on a loaded machine)."""


def promql(prom: str, query: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": query}, timeout=30)
    if r.status_code == 503:
        raise NotReady(r.text)
    assert r.status_code == 200, (query, r.text)
    data = r.json()["data"]
    assert data["resultType"] == "vector", query
    return data["result"]


def wait_for(prom: str, query: str, ok, timeout: float = 60) -> list[dict]:
    deadline, rows = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        try:
            rows = promql(prom, query)
        except (httpx.HTTPError, NotReady):
            rows = []
        if ok(rows):
            return rows
        time.sleep(0.5)
    raise AssertionError(f"{query}: {rows}")


@pytest.fixture(scope="module")
def prom(serve_url, tmp_path_factory, prometheus):
    """Prometheus, started before the traffic so that its rates see the traffic arrive."""
    with running_prometheus(prometheus, serve_url.removeprefix("http://"), tmp_path_factory.mktemp("prom")) as url:
        wait_for(url, f'vllm:num_requests_running{{model_name="{MODEL}"}}', lambda rows: len(rows) == 1)
        yield url


def completion(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, stream: bool) -> list[str]:
    """A chat's finish reasons (one choice), streamed or not."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count: one two three"}], "max_tokens": 6,
            "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        return [c["finish_reason"] for c in r.json()["choices"]]
    reasons = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c.get("finish_reason")]
    return reasons


def settled(url: str) -> str:
    """/metrics once MODEL's count of finished requests stands still: replicas push their snapshots
    every second, so an earlier test's last requests on the shared app can land a second late."""
    def count(text: str) -> float:
        return value(sample_values(text), "vllm:e2e_request_latency_seconds_count", model_name=MODEL)

    last = httpx.get(f"{url}/metrics", timeout=30).text
    for _ in range(20):
        time.sleep(1.5)
        now = httpx.get(f"{url}/metrics", timeout=30).text
        if count(now) == count(last):
            return now
        last = now
    return last


@pytest.fixture(scope="module")
def traffic(serve_url, prom):
    """Completions and chats to MODEL: varied lengths, a repeated prompt (prefix-cache hits), stop
    strings and length limits, n=2. Returns /metrics before and after, and the reasons and requests sent."""
    before = settled(serve_url)
    reasons: list[str] = []
    requests = 0
    for words, max_tokens in ((3, 4), (20, 24), (60, 12)):
        out = completion(serve_url, prompt=" ".join(["seven"] * words), max_tokens=max_tokens, ignore_eos=True)
        reasons += [c["finish_reason"] for c in out["choices"]]
        requests += 1
    shared = "the same long prompt, word for word, every time: " * 3  # >= 3 blocks of 4 tokens
    for _ in range(3):  # two replicas: at least one of them sees it twice
        reasons += [c["finish_reason"] for c in completion(serve_url, prompt=shared, max_tokens=4)["choices"]]
        requests += 1
    out = completion(serve_url, prompt="stop here", max_tokens=12, ignore_eos=True)
    reasons += [c["finish_reason"] for c in out["choices"]]
    requests += 1
    stops = sorted(set(out["choices"][0]["text"]))[:16]  # greedy again: it stops at the first of its own characters
    assert stops, out
    out = completion(serve_url, prompt="stop here", max_tokens=12, ignore_eos=True, stop=stops)
    reasons += [c["finish_reason"] for c in out["choices"]]
    requests += 1
    out = completion(serve_url, prompt="two samples", max_tokens=6, n=2, temperature=0.8, seed=1, ignore_eos=True)
    reasons += [c["finish_reason"] for c in out["choices"]]
    requests += 1
    for stream in (False, True):
        reasons += chat(serve_url, stream)
        requests += 1
    samples = len(reasons)
    base = value(sample_values(before), "vllm:e2e_request_latency_seconds_count", model_name=MODEL)
    deadline = time.monotonic() + 30  # replicas push snapshots every second
    while True:
        after = httpx.get(f"{serve_url}/metrics", timeout=30).text
        count = value(sample_values(after), "vllm:e2e_request_latency_seconds_count", model_name=MODEL)
        if count - base >= samples or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # Prometheus has scraped them all
    wait_for(prom, f'vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}',
             lambda rows: len(rows) == 1 and float(rows[0]["value"][1]) == count)
    return sample_values(before), after, Counter(reasons), requests


def test_counts_follow_the_traffic(traffic):
    before, after_text, reasons, requests = traffic
    after = sample_values(after_text)

    def delta(name: str, **labels) -> float:
        return value(after, name, model_name=MODEL, **labels) - value(before, name, model_name=MODEL, **labels)

    assert reasons["stop"] >= 1 and reasons["length"] >= 1, reasons
    for reason in FINISH_REASONS:
        assert delta("vllm:request_success_total", finished_reason=reason) == reasons[reason], reason
    samples = sum(reasons.values())
    assert delta("vllm:e2e_request_latency_seconds_count") == delta("vllm:time_to_first_token_seconds_count") == samples
    assert delta("vllm:request_params_n_count") == delta("vllm:request_max_num_generation_tokens_count") == requests
    assert delta("vllm:request_params_n_sum") == requests + 1  # one request had n=2
    assert delta("vllm:prefix_cache_hits_total") > 0
    for ours, theirs in (("prompt_tokens", "prompt_tokens"), ("generation_tokens", "generation_tokens"),
                         ("prefix_cache_queries", "prefix_cache_queries"), ("prefix_cache_hits", "prefix_cache_hits"),
                         ("preemptions", "num_preemptions")):
        assert value(after, f"vllm:{theirs}_total", model_name=MODEL) == value(after, f"attnserve_{ours}_total",
                                                                                model=MODEL)


def test_kinds_labels_and_buckets_over_serve(traffic):
    check_kinds_labels_and_buckets(traffic[1], MODEL, 256)  # serve_url's --max-model-len


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel of vLLM's dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_the_dashboard_reads_only_families_we_serve():
    """Without Ray: each series a panel reads is one of ours, and its one variable is model_name."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v.get("definition") for v in dash["templating"]["list"] if v["type"] == "query"}
    assert variables == {"model_name": "label_values(model_name)"}
    read = {re.sub(r"_(bucket|sum|count|total)$", "", name) for _, expr in dashboard_queries()
            for name in re.findall(r"vllm:[A-Za-z0-9_]+", expr)}
    assert read and read <= set(VLLM), read - set(VLLM)


def test_every_dashboard_query_returns_data(traffic, prom):
    # the dashboard's model_name variable: label_values(model_name)
    r = httpx.get(f"{prom}/api/v1/label/model_name/values", timeout=30)
    assert {"tiny-gqa", "tiny-mha", "tiny-mqa"} <= set(r.json()["data"])
    empty, not_finite = [], []
    for title, expr in dashboard_queries():
        query = expr.replace("$model_name", MODEL).replace("$__rate_interval", WINDOW)
        assert "$" not in query, query  # a variable this test does not know
        rows = promql(prom, query)
        if not rows:  # NOTE: a gauge leaves /metrics while its replica's report is late (STALE_AFTER_S, a
            # loaded CI machine): it must come back, not stay away
            try:
                rows = wait_for(prom, query, bool, timeout=45)
            except AssertionError:
                empty.append((title, query))
        not_finite += [(title, query, row) for row in rows if not math.isfinite(float(row["value"][1]))]
    assert not empty, empty
    assert not not_finite, not_finite
