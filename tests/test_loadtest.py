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


def test_compare_http_burst_prompts_vllm_command_and_skip(tiny_checkpoints, tmp_path, capsys):
    """Burst prompts are exact, distinct and seeded; vLLM gets both cores and is skipped without its venv."""
    from loadtests.burst import burst_prompts
    from loadtests.compare_http import KEYS, main, server

    a, b = burst_prompts(384, 4, 16, 0), burst_prompts(384, 4, 16, 1)
    assert a == burst_prompts(384, 4, 16, 0) and all(len(p) == 16 and min(p) >= 100 for p in a + b)
    assert len({tuple(p[:16]) for p in a + b}) == 8  # no two share a first KV block
    cmd, model, env = server("vllm", tmp_path, 8000, "bfloat16", 2, tmp_path / "peers")
    assert cmd[:4] == [str(tmp_path / "peers" / "bin" / "python"), "-P", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prefix-caching" in cmd and model == "default" and "OMP_NUM_THREADS" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    with pytest.raises(SystemExit):
        main(["--mode", "burst", "--systems", "transformers_serve"])
    out = tmp_path / "burst.json"
    main(["--mode", "burst", "--systems", "vllm", "--model", str(tiny_checkpoints["llama"]),
          "--peers-venv", str(tmp_path / "missing"), "--json", str(out), "--out", str(tmp_path / "out")])
    assert "vllm: skipped" in capsys.readouterr().out
    row = json.loads(out.read_text())["vllm"]
    assert set(KEYS) <= set(row) and row["output_tokens_per_s"] is None and "make peers" in row["skipped"]


def test_compare_http_llama_server_command_and_skip(tiny_checkpoints, tmp_path, capsys):
    """llama-server gets the GGUF file, a slot per burst request and the threads; a safetensors model skips it."""
    from loadtests.compare_http import gguf_of, main, server

    (tmp_path / "model.gguf").write_bytes(b"")
    cmd, model, _ = server("llama_server", tmp_path, 8000, "bfloat16", 2, slots=16)
    assert cmd[cmd.index("-m") + 1] == str(tmp_path / "model.gguf") and cmd[cmd.index("-np") + 1] == "16"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("--port") + 1] == "8000" and model == "default"
    assert gguf_of(tmp_path / "model.gguf") == tmp_path / "model.gguf" and gguf_of(tiny_checkpoints["llama"]) is None
    main(["--mode", "burst", "--systems", "llama_server", "--model", str(tiny_checkpoints["llama"]),
          "--out", str(tmp_path / "out")])
    assert "llama_server: skipped" in capsys.readouterr().out


@pytest.mark.slow
def test_short_headless_locust_run(serve_url, tmp_path):
    from matplotlib.image import imread

    from loadtests.run_loadtest import main

    workload = tmp_path / "workload.jsonl"
    spec = LengthSpec(median=8, sigma=0.5, min_words=2, max_words=20, long_min=20, long_max=30, shared_prefix_words=15)
    workload.write_text("\n".join(json.dumps(r) for r in build(300, 0, spec, max_tokens=(8, 16))))
    out = tmp_path / "run"
    summary = main(["--url", serve_url, "--users", "6", "--spawn-rate", "6", "--duration", "12s", "--scenario", "all",
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
