"""`attnserve eval`: perplexity against KV bytes per token for a model's MHA / GQA / MQA forms."""
import json
import math

import pytest
import torch

from models import load_model, load_tokenizer
from models.perplexity import perplexity
from server.cli import EVAL_KEYS, main

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York, and all the clouds "
        "that lour'd upon our house in the deep bosom of the ocean buried. ") * 4  # about 400 tokens: within the tiny models' 512 positions


def test_perplexity_equals_transformers_loss(tiny_checkpoints):
    """One window over the whole text: exp of HF's mean next-token loss; sliding windows score every
    token once, so with a window as long as the text they agree too."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["llama"]
    ids = load_tokenizer(path)(TEXT)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    ours = load_model(path, torch.float32)
    assert perplexity(ours, ids, window=len(ids), stride=len(ids)) == pytest.approx(math.exp(loss), rel=1e-5)
    sliding = perplexity(ours, ids, window=32, stride=8)  # several windows, each scoring 8 new tokens
    assert sliding != pytest.approx(math.exp(loss), rel=1e-6) and math.isfinite(sliding) and sliding > 1


def test_eval_table_mha_expansion_equals_gqa(tiny_variants, tmp_path, capsys, monkeypatch):
    from server import eval_results

    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "cache"))  # where the dashboard's copy goes
    text, out = tmp_path / "text.txt", tmp_path / "eval.json"
    text.write_text(TEXT)
    args = ["eval", "--text", str(text), "--dtype", "float32", "--window", "48", "--stride", "16", "--json", str(out)]
    for name in ("tiny-gqa", "tiny-mha", "tiny-mqa"):
        args += ["--model", str(tiny_variants[name])]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert all(tuple(r) == EVAL_KEYS for r in rows)
    gqa, mha, mqa = rows
    assert (gqa["attention"], mha["attention"], mqa["attention"]) == ("gqa", "mha", "mqa")
    assert (gqa["kv_heads"], mha["kv_heads"], mqa["kv_heads"]) == (2, 4, 1)
    assert mha["kv_bytes_per_token"] == 2 * gqa["kv_bytes_per_token"] == 4 * mqa["kv_bytes_per_token"]
    assert all(r["kv_cache_dtype"] == "float32" for r in rows)
    assert mha["perplexity"] == pytest.approx(gqa["perplexity"], rel=1e-6)  # repeating K/V heads is exact
    assert mqa["perplexity"] != pytest.approx(gqa["perplexity"], rel=1e-4)  # mean-pooling is not
    table = capsys.readouterr().out
    assert "perplexity" in table and str(tiny_variants["tiny-mqa"]) in table
    assert eval_results.load() == rows  # kept for the dashboard too


def test_eval_with_an_8bit_kv_cache(tiny_checkpoints, tmp_path, monkeypatch):
    """`--kv-cache-dtype fp8_e4m3`: each window goes through an 8-bit pool and the paged kernel, so
    the rounding shows in the score; a quarter of fp32's bytes per token; both rows kept."""
    from kvcache.paged_attention import PagedAttention
    from kvcache.storage import KVCacheSpec, PagedKVCache
    from server import eval_results

    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_checkpoints["llama"]
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    rows = []
    for kv in ("auto", "fp8_e4m3"):
        out = tmp_path / f"{kv}.json"
        assert main(["eval", "--text", str(text), "--dtype", "float32", "--kv-cache-dtype", kv, "--window", "48",
                     "--stride", "16", "--model", str(path), "--json", str(out)]) == 0
        rows += json.loads(out.read_text())
    full, fp8 = rows
    assert (full["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("float32", "fp8_e4m3")
    assert full["kv_bytes_per_token"] == 4 * fp8["kv_bytes_per_token"] == 4 * 2 * 2 * 2 * 16
    assert fp8["perplexity"] != pytest.approx(full["perplexity"], rel=1e-6)
    assert fp8["perplexity"] == pytest.approx(full["perplexity"], rel=0.05)
    assert eval_results.load() == rows  # one row per model and KV dtype
    # the paged path with a full-precision pool is the dense model's own perplexity
    model = load_model(path, torch.float32)
    ids = load_tokenizer(path)(TEXT)["input_ids"]
    cache = PagedKVCache(KVCacheSpec(2, 2, 16, torch.float32), num_blocks=3)
    paged = perplexity(model, ids, window=48, stride=16, attention=lambda n: PagedAttention.one_sequence(cache, n))
    assert paged == pytest.approx(perplexity(model, ids, window=48, stride=16), rel=1e-5)
    assert paged == pytest.approx(full["perplexity"], rel=1e-9)
