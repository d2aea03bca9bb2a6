"""Load tests: the workload generator, and a short headless locust run against real Serve."""
import csv
import json
import statistics

import pytest

from loadtests.workload import LengthSpec, build


def test_workload_is_deterministic_and_follows_its_length_distribution():
    spec = LengthSpec(median=60, sigma=0.7, min_words=5, max_words=400, long_min=500, long_max=800)
    a, b, c = build(1500, 1, spec), build(1500, 1, spec), build(1500, 2, spec)
    assert a == b and a != c
    chat = [r["num_words"] for r in a if r["kind"] == "chat"]
    assert abs(statistics.median(chat) - 60) <= 6
    assert min(chat) >= 5 and max(chat) <= 400
    lognormal_iqr = statistics.quantiles(chat, n=4)
    assert lognormal_iqr[0] < 60 < lognormal_iqr[2] and lognormal_iqr[2] / lognormal_iqr[0] > 1.5
    long = [r["num_words"] for r in a if r["kind"] == "long"]
    assert long and all(500 <= n <= 800 for n in long)
    share = {k: sum(r["kind"] == k for r in a) / len(a) for k in ("chat", "long", "shared_prefix")}
    assert abs(share["chat"] - 0.8) < 0.04 and abs(share["long"] - 0.1) < 0.03
    for r in a[:50]:
        if r["kind"] != "shared_prefix":
            assert len(r["prompt"].split()) == r["num_words"]
    prefixes = {r["prompt"][:200] for r in a if r["kind"] == "shared_prefix"}
    assert len(prefixes) == 1  # one shared system passage


@pytest.mark.slow
def test_short_headless_locust_run(serve_url, tmp_path):
    from matplotlib.image import imread

    from loadtests.run_loadtest import main

    workload = tmp_path / "workload.jsonl"
    spec = LengthSpec(median=8, sigma=0.5, min_words=2, max_words=20, long_min=20, long_max=30, shared_prefix_words=15)
    workload.write_text("\n".join(json.dumps(r) for r in build(300, 0, spec, max_tokens=(8, 16))))
    out = tmp_path / "run"
    summary = main(["--url", serve_url, "--users", "6", "--spawn-rate", "6", "--duration", "20s", "--scenario", "all",
                    "--models", "tiny-gqa,tiny-mha,tiny-mqa", "--workload", str(workload), "--out", str(out)])
    assert summary["locust_exit_code"] == 0 and summary["failures"] == 0
    assert summary["requests"] > 20 and summary["output_tokens"] > 0
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"] and summary["itl_p50_s"] > 0
    with (out / "locust_stats.csv").open() as f:
        rows = list(csv.DictReader(f))
    names = {(r["Type"], r["Name"]) for r in rows}
    assert {("TTFT", "chat-stream"), ("POST", "completion"), ("POST", "shared-prefix"), ("POST", "long-prompt")} <= names
    assert any(n.startswith("mixed:tiny-") for _, n in names)
    with (out / "locust_stats_history.csv").open() as f:
        assert len(list(csv.DictReader(f))) > 5
    for png in ("throughput.png", "latency.png", "kv_bytes.png"):
        image = imread(out / png)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # not a blank canvas
