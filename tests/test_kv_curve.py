"""KV bytes against sequence length (issue 23, "memory shown"): with sliding-window layers a sequence's
KV is no longer kv_bytes_per_token x length. server/kv_forms.kv_bytes_at is the curve, equal to the
pool's own KVCacheSpec.bytes_for; metrics, /v1/models, the dashboard and eval report it."""
import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvcache.storage import KVCacheSpec
from models.native.cpu_path import CpuPath
from server.dashboard import dashboard_data
from server.kv_forms import KV_CURVE_LENGTHS, curve_lengths, kv_bytes_at, kv_bytes_per_token_at, kv_curve, kv_forms
from server.metrics import MetricsRecorder
from server.prometheus import render_prometheus
from server.wire import EngineStats, ModelInfo

# per layer: a window in tokens or None (global)
LAYOUTS = {
    "all global": (),
    "all global, spelled out": (None,) * 4,
    "mistral (every layer windowed)": (4096,) * 4,
    "gemma 2 (alternating)": (4096, None) * 3,
    "gemma 3 (5 windowed : 1 global)": ((1024,) * 5 + (None,)) * 2,
    "window 1": (1, None, 1, None),
    "window 15": (15, 15, None),
    "window 16": (16, None, None, 16),
    "window 17": (17, 17, 17, None),
    "two windows": (17, 40, None, 40, 17, None),
}
CPU = CpuPath("cpu", "avx2", "float32", "float32", "torch", "sdpa", 1)


@pytest.mark.parametrize("windows", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("block_size", (1, 4, 16))
def test_kv_bytes_at_is_what_the_pool_holds(windows, block_size):
    layers = len(windows) or 6
    spec = KVCacheSpec(layers, 3, 64, torch.bfloat16, block_size, windows)
    for n in range(0, 5001):
        assert kv_bytes_at(spec.bytes_per_token, windows, block_size, n) == spec.bytes_for(n), n


def test_per_token_bytes_bend_at_the_window():
    per_token = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M's shape, bf16
    flat = [kv_bytes_per_token_at(per_token, (), 16, n) for n in (16, 1024, 8192, 32768)]
    assert flat == [per_token] * 4  # global: flat at multiples of the block
    assert kv_bytes_per_token_at(per_token, (), 16, 1) == 16 * per_token  # one token holds a whole block
    gemma2 = (4096, None) * 15
    at = kv_curve(per_token, gemma2, 16)
    assert at["1024"] == per_token  # inside the window every layer holds every token
    assert per_token / 2 < at["32768"] < per_token / 2 * 1.15  # past it, the global half and a little
    assert at["8192"] > at["32768"]
    mistral = (4096,) * 30  # every layer windowed: a sequence's bytes stop growing at window + one block
    assert kv_bytes_at(per_token, mistral, 16, 10**6) == kv_bytes_at(per_token, mistral, 16, 4096 + 16) == \
        per_token * (4096 + 16)
    with pytest.raises(ValueError):
        kv_bytes_per_token_at(per_token, (), 16, 0)


def test_curve_lengths_are_block_multiples_and_powers_of_two():
    lens = curve_lengths(16, 32768)
    assert lens[0] == 16 and lens[-1] == 32768 and lens == sorted(set(lens))
    assert all(n % 16 == 0 for n in lens) and {2 ** k for k in range(4, 16)} <= set(lens)
    assert len(lens) < 60
    assert {16, 32, 64} <= set(curve_lengths(32, 256))  # the capacity chart's lengths, whatever the block


def test_kv_forms_unchanged_for_global_models():
    rows = kv_forms(num_heads=9, num_kv_heads=3, kv_bytes_per_token=23040, pool_bytes=2**30, block_size=16)
    assert [(r["attention"], r["kv_heads"], r["kv_bytes_per_token"], r["what_if"], r["sliding_window"])
            for r in rows] == [("mha", 9, 69120, True, False), ("gqa", 3, 23040, False, False),
                               ("mqa", 1, 7680, True, False)]
    assert [r["admitted_requests"] for r in rows] == [2**30 // (b * 16) // 64 for b in (69120, 23040, 7680)]
    assert [r["kv_bytes_per_token_at"] for r in rows] == [{str(n): float(b) for n in KV_CURVE_LENGTHS}
                                                          for b in (69120, 23040, 7680)]


@pytest.mark.parametrize("seq_len", (1024, 8192, 32768))
def test_kv_forms_of_a_windowed_model(seq_len):
    windows = (4096, None) * 15  # SmolLM2's shape as Gemma 2 would lay it out
    pool_blocks = 5000
    spec = KVCacheSpec(30, 3, 64, torch.bfloat16, 16, windows)
    rows = kv_forms(9, 3, spec.bytes_per_token, pool_blocks * spec.bytes_per_block, 16, seq_len, windows)
    assert [(r["attention"], r["kv_heads"], r["sliding_window"], r["what_if"]) for r in rows] == [
        ("mha", 9, True, True), ("gqa", 3, True, False), ("mqa", 1, True, True),
        ("gqa", 3, False, True)]  # the served heads with every layer global: what the windows save
    served, global_ = rows[1], rows[3]
    # admitted: the pool's block ids over the blocks one request holds, as the scheduler counts them
    assert served["admitted_requests"] == pool_blocks // spec.blocks_for(seq_len)
    pool_bytes = pool_blocks * spec.bytes_per_block
    assert global_["admitted_requests"] == pool_bytes // (spec.bytes_per_token * 16) // (seq_len // 16)
    assert (served["admitted_requests"] > global_["admitted_requests"]) == (seq_len > 4096)
    for r in rows:
        w = windows if r["sliding_window"] else ()
        assert r["kv_bytes_per_token_at"] == {str(n): kv_bytes_at(r["kv_bytes_per_token"], w, 16, n) / n
                                              for n in KV_CURVE_LENGTHS}


# ---- metrics ---------------------------------------------------------------------------------------------------
def parse(text: bytes) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def value(samples, name, **labels):
    (v,) = [v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items())]
    return v


def windowed_info(windows=(24, None), block_kv_bytes=None, max_model_len=256) -> ModelInfo:
    """2 layers x 2 kv heads x 8 dims x 2 bytes x K and V = 128 bytes per token of both layers; with one
    windowed and one global layer a block id is one layer's 16 tokens: 1,024 bytes."""
    spec = KVCacheSpec(2, 2, 8, torch.bfloat16, 16, windows)
    assert spec.bytes_per_token == 128
    return ModelInfo(max_model_len, "gqa", 2, 128, 100, 16, 100, 4, "bfloat16", CPU, "none", 1000, None, windows,
                     spec.bytes_per_block if block_kv_bytes is None else block_kv_bytes,
                     ("sliding_window",) if any(windows) else ())


def engine_stats(used: int) -> EngineStats:
    return EngineStats(time.time(), 1, 0, 100, used, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def test_metrics_pool_bytes_and_curve_of_a_windowed_model(promtool):
    info = windowed_info()
    assert info.kv_block_bytes == 1024  # one layer's block: half of kv_bytes_per_token x block_size
    snap = MetricsRecorder("w", info).snapshot(engine_stats(used=7))
    assert (snap.gauges.kv_bytes_total, snap.gauges.kv_bytes_used) == (100 * 1024, 7 * 1024)
    # an old constructor (no windows, kv_block_bytes 0): a block of every layer
    old = ModelInfo(256, "gqa", 2, 128, 100, 16, 100, 4, "bfloat16", CPU, "none", 1000, None)
    old_snap = MetricsRecorder("g", old).snapshot(engine_stats(used=7))
    assert (old_snap.gauges.kv_bytes_total, old_snap.gauges.kv_bytes_used) == (100 * 2048, 7 * 2048)
    text = render_prometheus([snap, old_snap])
    s = parse(text)
    assert value(s, "attnserve_kv_bytes", model="w", state="capacity") == 100 * 1024
    assert value(s, "attnserve_kv_bytes_per_token", model="w") == 128  # unchanged: a token of every layer
    spec = KVCacheSpec(2, 2, 8, torch.bfloat16, 16, (24, None))
    for n in KV_CURVE_LENGTHS:
        assert value(s, "attnserve_kv_bytes_per_token_at_length", model="w", tokens=str(n)) == spec.bytes_for(n) / n
        assert value(s, "attnserve_kv_bytes_per_token_at_length", model="g", tokens=str(n)) == 128
    assert value(s, "attnserve_kv_bytes_per_token_at_length", model="w", tokens="32768") == pytest.approx(64, rel=0.01)
    assert promtool(text) == []


def test_dashboard_data_of_a_windowed_model():
    snaps = [MetricsRecorder("w", windowed_info()).snapshot(engine_stats(used=0)),
             MetricsRecorder("g", windowed_info(windows=())).snapshot(engine_stats(used=0))]
    w, g = sorted(dashboard_data(snaps)["models"], key=lambda m: m["model"], reverse=True)
    assert (w["layer_windows"], w["kv_block_bytes"], w["attention_variants"]) == ([24, None], 1024, ["sliding_window"])
    assert (g["layer_windows"], g["kv_block_bytes"], g["attention_variants"]) == ([], 2048, [])
    spec = KVCacheSpec(2, 2, 8, torch.bfloat16, 16, (24, None))
    assert w["kv_curve"] == [[n, spec.bytes_for(n)] for n in curve_lengths(16, 32768)]
    assert all(b == 128 * n for n, b in g["kv_curve"])  # flat: every point a multiple of the block
    assert w["kv_bytes_per_token_at"]["32768"] < 0.51 * 128 and g["kv_bytes_per_token_at"]["32768"] == 128
    # the forms' pool is the replica's blocks x kv_block_bytes; a request of 1,024 tokens holds 64 blocks of the
    # global layer and 3 of the windowed one (24 tokens span at most 3 blocks of 16)
    served = next(f for f in w["forms"] if not f["what_if"])
    assert served["sliding_window"] and served["admitted_requests"] == 100 // (64 + 3)
    assert [f["admitted_requests"] for f in g["forms"] if not f["what_if"]] == [100 // 64]
    assert len(w["forms"]) == 4 and len(g["forms"]) == 3


# ---- /v1/models ------------------------------------------------------------------------------------------------
class InfoClient:
    def __init__(self, info: ModelInfo) -> None:
        self._info = info

    async def info(self) -> ModelInfo:
        return self._info


def models_json(clients: dict) -> dict:
    from server.http_app import create_app
    from server.openai_api import OpenAIApi

    async def go():
        transport = httpx.ASGITransport(app=create_app(OpenAIApi(clients)))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return (await c.get("/v1/models")).json()
    return {m["id"]: m for m in asyncio.run(go())["data"]}


def test_v1_models_shows_windows_and_the_curve():
    old = ModelInfo(256, "gqa", 2, 128, 100, 16, 100, 4, "float32", CPU, "none", 1000, None)
    models = models_json({"w": InfoClient(windowed_info()), "old": InfoClient(old)})
    w, g = models["w"], models["old"]
    assert w["kv_bytes_per_token"] == g["kv_bytes_per_token"] == 128  # every layer, as before
    assert (w["layer_windows"], w["attention_variants"], w["block_size"], w["kv_block_bytes"]) == \
        ([24, None], ["sliding_window"], 16, 1024)
    assert (g["layer_windows"], g["attention_variants"], g["kv_block_bytes"]) == ([], [], 2048)
    assert g["kv_bytes_per_token_at"] == {"1024": 128, "8192": 128, "32768": 128}
    assert w["kv_bytes_per_token_at"] == {str(n): kv_bytes_at(128, (24, None), 16, n) / n for n in KV_CURVE_LENGTHS}
    assert w["kv_bytes_per_token_at"]["1024"] == (1024 * 64 + 3 * 16 * 64) / 1024  # the global layer's every token,
    # the windowed layer's 3 blocks of 16 (64 bytes per layer and token)


# ---- end to end: the tiny Gemma 2 served over HTTP --------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma2_server(variant_checkpoints):
    """The tiny Gemma 2 (2 layers: one windowed at tests/tiny.py WINDOW, one global) behind the real app on
    uvicorn, one in-process replica (no Ray)."""
    import uvicorn

    from loadtests.servers import free_port
    from server.engine import EngineConfig
    from server.http_app import create_app
    from server.model_client import LocalModelClient
    from server.openai_api import OpenAIApi
    from server.worker import ModelWorker

    path = variant_checkpoints["gemma2"]
    worker = ModelWorker("tiny-gemma2", EngineConfig(model=str(path), dtype="float32", num_blocks=64, block_size=4,
                                                     max_model_len=256, enforce_eager=True))

    async def snapshots():
        return [worker.snapshot()]
    app = create_app(OpenAIApi({"tiny-gemma2": LocalModelClient(worker)}), snapshots=snapshots)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.1)
    yield url
    server.should_exit = True
    thread.join(timeout=30)
    worker.shutdown()


def test_a_windowed_model_end_to_end(gemma2_server, tmp_path, chromium):
    from tests.tiny import WINDOW

    url = gemma2_server
    (model,) = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    per_token = model["kv_bytes_per_token"]
    assert per_token == 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 kv heads x head_dim 16 x fp32
    assert model["layer_windows"] == [WINDOW, None] and "sliding_window" in model["attention_variants"]
    assert model["kv_block_bytes"] == per_token * 4 // 2  # a block id: one layer's 4 tokens
    at = model["kv_bytes_per_token_at"]
    assert at["1024"] > at["8192"] > at["32768"] and at["32768"] == pytest.approx(per_token / 2, rel=0.01)
    # a request past the window: what it held is counted in blocks of one layer
    body = {"model": "tiny-gemma2", "prompt": list(range(10, 70)), "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["kv_cache_bytes"] % model["kv_block_bytes"] == 0
    # at least the curve's (a prompt computed in one step holds every layer's blocks until it ends), below every
    # layer's blocks of the whole sequence: the windowed layer let go of the blocks that left its window
    seq = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # the last token is never cached
    held = usage["kv_cache_bytes"]
    assert kv_bytes_at(per_token, (WINDOW, None), 4, seq) <= held < kv_bytes_at(per_token, (), 4, seq)
    deadline = time.monotonic() + 30
    while True:
        s = parse(httpx.get(f"{url}/metrics", timeout=30).content)
        if any(n == "attnserve_requests_total" for n, _ in s) or time.monotonic() > deadline:  # the request counted
            break
        time.sleep(0.2)
    assert value(s, "attnserve_kv_bytes", model="tiny-gemma2", state="capacity") == 64 * model["kv_block_bytes"]
    assert value(s, "attnserve_request_kv_cache_bytes_sum", model="tiny-gemma2") == usage["kv_cache_bytes"]
    for n in KV_CURVE_LENGTHS:
        assert value(s, "attnserve_kv_bytes_per_token_at_length", model="tiny-gemma2", tokens=str(n)) == at[str(n)]
    data = httpx.get(f"{url}/dashboard/data", timeout=30).json()
    (m,) = data["models"]
    assert m["layer_windows"] == [WINDOW, None] and m["kv_bytes_per_token_at"] == at
    assert [f["sliding_window"] for f in m["forms"]] == [True, True, True, False]
    # the page draws the curve: one line, its points the server's
    res = chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", f"{url}/dashboard")
    assert res.returncode == 0, res.stderr[-2000:]
    charts = dict(re.findall(r'id="(chart-[a-z-]+)"[^>]*data-points="([^"]*)"', res.stdout))
    points = json.loads(charts["chart-bytes-per-token"].replace("&quot;", '"'))
    assert points == {"tiny-gemma2": len(m["kv_curve"])}
    assert json.loads(charts["chart-capacity"].replace("&quot;", '"'))["tiny-gemma2"] > 0
    forms = re.search(r'<table id="forms">(.*?)</table>', res.stdout, re.S).group(1)
    assert forms.count("what-if") == 3 and forms.count("served") == 1
    assert f"<td>{WINDOW}&nbsp;(1/2&nbsp;layers)</td>" in forms


# ---- attnserve eval and the length sweep --------------------------------------------------------------------------
def test_eval_row_carries_the_curve_of_a_windowed_model(tmp_path, monkeypatch, variant_checkpoints):
    """`attnserve eval` on the tiny Gemma 2: its pool is built with the model's windows (KVCacheSpec.of), so
    the score is the dense model's and the row's per-token bytes fall to the global layer's half."""
    from models import load_model, load_tokenizer
    from models.perplexity import perplexity
    from server import eval_results
    from server.cli import EVAL_KEYS, main
    from tests.test_eval import TEXT
    from tests.tiny import WINDOW

    # NOTE: the rows' file only: a fresh ATTNSERVE_CACHE_DIR would rebuild the native kernels too (minutes)
    monkeypatch.setattr(eval_results, "results_path", lambda: tmp_path / "eval" / "results.json")
    path = variant_checkpoints["gemma2"]
    text, out = tmp_path / "text.txt", tmp_path / "eval.json"
    text.write_text(TEXT)
    assert main(["eval", "--text", str(text), "--dtype", "float32", "--window", "48", "--stride", "16",
                 "--model", str(path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert tuple(row) == EVAL_KEYS
    per_token = row["kv_bytes_per_token"]
    assert per_token == 2 * 2 * 2 * 16 * 4  # every layer, as before
    spec = KVCacheSpec(2, 2, 16, torch.float32, 16, (WINDOW, None))
    assert row["kv_bytes_per_token_at"] == {str(n): spec.bytes_for(n) / n for n in KV_CURVE_LENGTHS}
    assert row["kv_bytes_per_token_at"]["32768"] == pytest.approx(per_token / 2, rel=0.01)
    model = load_model(path, torch.float32)
    ids = load_tokenizer(path)(TEXT)["input_ids"]
    assert row["perplexity"] == pytest.approx(perplexity(model, ids, window=48, stride=16), rel=1e-4)


def test_sweep_puts_the_models_curve_next_to_each_length():
    from loadtests.sweep_length import model_kv_bytes

    gemma = {"kv_bytes_per_token": 512, "layer_windows": [24, None], "block_size": 4}
    lengths = (8, 24, 100)
    assert [model_kv_bytes(gemma, n) for n in lengths] == [kv_bytes_at(512, (24, None), 4, n) for n in lengths]
    assert model_kv_bytes(gemma, 100) == 256 * 4 * (25 + 7)  # one layer's 25 blocks, the windowed one's 7
    assert model_kv_bytes({"kv_bytes_per_token": 512}, 100) == 512 * 112  # an older server: global, 16-token blocks
