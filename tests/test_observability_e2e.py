"""Metrics from real traffic through Ray Serve: 2 replicas of a GQA model plus its MHA and MQA
forms. Scraped and parsed, checked by promtool, scraped again by a real Prometheus, and drawn by
the built-in dashboard in headless Chromium."""
import json
import math
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.servers import free_port

MODELS = {"tiny-gqa": 2, "tiny-mha": 4, "tiny-mqa": 1}  # served name -> kv heads
BLOCK_SIZE = 4
COUNT = "attnserve_e2e_request_latency_seconds_count"  # one per finished request
OUTPUT = Path(__file__).resolve().parents[1] / "test-output"


def scrape(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def settled(url: str) -> dict:
    """A scrape once the counts of requests that finished before it stand still: replicas push their
    snapshots every second, so an earlier test's last requests on the shared app can land a second late."""
    last = scrape(url)
    for _ in range(20):
        time.sleep(1.5)
        now = scrape(url)
        if all(total(now, COUNT, model=m) == total(last, COUNT, model=m) for m in MODELS):
            return now
        last = now
    return last


@pytest.fixture(scope="module")
def traffic(serve_url):
    """Varied-length requests to every model; returns (before, after, per-model usages)."""
    before = settled(serve_url)
    prompts = [" ".join(str(i % 10) for i in range(n)) for n in (3, 10, 25, 60, 120)]

    def send(args):
        model, prompt, max_tokens = args
        r = httpx.post(f"{serve_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return model, r.json()["usage"]
    jobs = [(m, p, mt) for m in MODELS for p in prompts for mt in (4, 30)]
    with ThreadPoolExecutor(8) as pool:
        usages = list(pool.map(send, jobs))
    expected = {m: sum(1 for j in jobs if j[0] == m) for m in MODELS}
    deadline = time.monotonic() + 30  # replicas push snapshots every second
    while True:
        after = scrape(serve_url)
        done = all(total(after, COUNT, model=m) - total(before, COUNT, model=m) >= n for m, n in expected.items())
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return before, after, usages, expected


def test_histogram_counts_equal_requests_sent(traffic):
    before, after, _, expected = traffic
    for model, n in expected.items():
        for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_kv_cache_bytes",
                     "request_prompt_tokens"):
            name = f"attnserve_{hist}_count"
            assert total(after, name, model=model) - total(before, name, model=model) == n, (model, hist)
        lens = {dict(ls)["seq_len_bucket"] for (n_, ls), v in after.items()
                if n_ == "attnserve_time_to_first_token_seconds_count" and dict(ls)["model"] == model}
        assert len(lens) >= 3  # several sequence-length buckets were exercised


def test_per_request_kv_bytes_are_blocks_times_block_bytes(traffic):
    before, after, usages, _ = traffic
    for model, kv_heads in MODELS.items():
        per_token = total(after, "attnserve_kv_bytes_per_token", model=model)
        block_bytes = per_token * BLOCK_SIZE
        d_bytes = total(after, "attnserve_request_kv_cache_bytes_sum", model=model) - \
            total(before, "attnserve_request_kv_cache_bytes_sum", model=model)
        d_blocks = total(after, "attnserve_request_kv_blocks_sum", model=model) - \
            total(before, "attnserve_request_kv_blocks_sum", model=model)
        assert d_blocks > 0 and d_bytes == d_blocks * block_bytes
    for model, usage in usages:
        per_token = total(after, "attnserve_kv_bytes_per_token", model=model)
        blocks = math.ceil((usage["prompt_tokens"] + usage["completion_tokens"] - 1) / BLOCK_SIZE)
        assert usage["kv_cache_bytes"] == blocks * BLOCK_SIZE * per_token


def test_bytes_per_token_ratio_is_the_kv_head_ratio(traffic):
    _, after, _, _ = traffic
    bpt = {m: total(after, "attnserve_kv_bytes_per_token", model=m) for m in MODELS}
    assert bpt["tiny-mha"] / bpt["tiny-gqa"] == 4 / 2
    assert bpt["tiny-gqa"] / bpt["tiny-mqa"] == 2 / 1
    assert bpt["tiny-gqa"] == 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 kv heads x 16 dims x fp32


def test_two_replicas_are_summed(traffic):
    _, after, _, _ = traffic
    assert total(after, "attnserve_replicas", model="tiny-gqa") == 2
    assert total(after, "attnserve_replicas", model="tiny-mha") == 1
    assert total(after, "attnserve_kv_blocks", model="tiny-gqa", state="total") == 2 * 256
    assert total(after, "attnserve_kv_blocks", model="tiny-gqa", state="used") == 0  # all requests ended


def test_weight_bytes_gauge_per_model(serve_url, traffic):
    """attnserve_model_weight_bytes: one replica's weights (not summed over tiny-gqa's two), labelled
    with their format; the same numbers /v1/models gives."""
    _, after, _, _ = traffic
    models = {m["id"]: m for m in httpx.get(f"{serve_url}/v1/models", timeout=30).json()["data"]}
    for model in MODELS:
        (labels,) = [dict(ls) for (n, ls), _ in after.items() if n == "attnserve_model_weight_bytes"
                     and dict(ls)["model"] == model]
        assert labels["quantization"] == models[model]["quantization"] == "none"
        assert total(after, "attnserve_model_weight_bytes", model=model) == models[model]["weight_bytes"] > 0
        assert labels["kv_heads"] == str(MODELS[model]) and labels["kv_cache_dtype"] == "float32"


def test_promtool_check_metrics(serve_url, traffic, promtool):
    text = httpx.get(f"{serve_url}/metrics").content
    assert promtool(text) == []


def test_real_prometheus_scrapes_and_answers_promql(serve_url, traffic, tmp_path, prometheus, promtool):
    _, after, _, _ = traffic
    target = serve_url.removeprefix("http://")
    port = free_port()
    cfg = (Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "prometheus.yml").read_text()
    cfg = cfg.replace("scrape_interval: 5s", "scrape_interval: 1s").replace("127.0.0.1:8000", target)
    (tmp_path / "prometheus.yml").write_text(cfg)
    check = subprocess.run([promtool.path, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, result = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": "attnserve_kv_bytes_per_token"})
                result = r.json()["data"]["result"] if r.status_code == 200 else []
            except httpx.HTTPError:
                result = []
            if len(result) == len(MODELS):
                break
            time.sleep(1)
        got = {row["metric"]["model"]: float(row["value"][1]) for row in result}
        assert got == {m: total(after, "attnserve_kv_bytes_per_token", model=m) for m in MODELS}
        r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query",
                      params={"query": "sum by (model) (attnserve_e2e_request_latency_seconds_count)"})
        counts = {row["metric"]["model"]: float(row["value"][1]) for row in r.json()["data"]["result"]}
        assert counts == {m: total(after, "attnserve_e2e_request_latency_seconds_count", model=m) for m in MODELS}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_dashboard_draws_every_model_in_headless_chromium(serve_url, traffic, tmp_path, chromium):
    res = chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", f"{serve_url}/dashboard")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    import re

    charts = dict(re.findall(r'id="(chart-[a-z-]+)"[^>]*data-points="([^"]*)"', dom))
    assert set(charts) == {"chart-bytes-per-token", "chart-kv-per-request", "chart-ttft", "chart-itl", "chart-capacity"}
    for chart, raw in charts.items():
        points = json.loads(raw.replace("&quot;", '"'))
        assert set(points) == set(MODELS), (chart, points)
        assert all(n > 0 for n in points.values()), (chart, points)
    forms = re.search(r'<table id="forms">(.*?)</table>', dom, re.S).group(1)
    assert forms.count("what-if") == 2 * len(MODELS) and forms.count("served") == len(MODELS)  # each model's 3 forms
    assert re.search(r'<table id="eval">.+?</table>', dom, re.S)
    for model, kv_heads in MODELS.items():  # labels carry the KV cache's storage dtype
        assert f"<td>{model} ({model[5:].upper()}, {kv_heads} kv, float32)</td>" in dom
    weights = {m["id"]: m["weight_bytes"] for m in httpx.get(f"{serve_url}/v1/models", timeout=30).json()["data"]}
    models_table = re.search(r'<table id="models">(.*?)</table>', dom, re.S).group(1)
    for model, n in weights.items():  # each model's row: its weights' format and bytes
        row = next(r for r in models_table.split("<tr>") if f"<td>{model} (" in r)
        assert f'data-weight-bytes="{n}" data-quantization="none">{n / 2**20:.1f} MiB, none</td>' in row, row
    OUTPUT.mkdir(exist_ok=True)
    shot = OUTPUT / "dashboard.png"
    res = chromium(f"--user-data-dir={tmp_path / 'profile2'}", f"--screenshot={shot}", f"{serve_url}/dashboard")
    assert res.returncode == 0 and shot.stat().st_size > 10_000


def test_attention_heatmap_page_in_headless_chromium(serve_url, tmp_path, chromium):
    """The page asks /v1/attention and draws the chosen layer and head with the tokens on both axes."""
    import re
    from urllib.parse import quote

    url = f"{serve_url}/dashboard/attention?model=tiny-gqa&layer=1&head=2&prompt={quote('The capital of France')}"
    res = chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", url)
    assert res.returncode == 0, res.stderr[-2000:]
    canvas = re.search(r'<canvas id="heatmap"[^>]*>', res.stdout).group(0)
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', canvas))
    assert int(attrs["tokens"]) > 2 and attrs["layer"] == "1" and attrs["head"] == "2", canvas
    assert 0 < float(attrs["max"]) <= 1
    OUTPUT.mkdir(exist_ok=True)
    shot = OUTPUT / "attention.png"
    res = chromium(f"--user-data-dir={tmp_path / 'profile2'}", f"--screenshot={shot}", url)
    assert res.returncode == 0 and shot.stat().st_size > 10_000
