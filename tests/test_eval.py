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


# Issue 23: a model whose positions are at most the stride (the default 1024 / 512 on a 512-position model
# left the stride at the window, and the second window scored its row 0 with no context: a crash).
LONG_TEXT = TEXT * 5  # 640 words, about 2000 tokens: four windows of a 512-position model


@pytest.fixture(scope="module")
def short_context_qwen2(tmp_path_factory):
    """The tiny Qwen2 as made (512 positions) and the same weights declared with 384 (RoPE: no learned
    positions, so only the config changes)."""
    import shutil

    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("short-context")
    full = make_checkpoint(root / "qwen2-512", "qwen2")
    short = shutil.copytree(full, root / "qwen2-384")
    cfg = json.loads((short / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 512
    cfg["max_position_embeddings"] = 384
    (short / "config.json").write_text(json.dumps(cfg))
    return {512: full, 384: short}


def reference_nll(hf, ids, window, stride, positions):
    """The transformers perplexity recipe written out: windows begin 0, s, 2s, ... of w tokens and each scores
    the tokens past the previous window's end; w is capped at the model's positions and s below w.
    Returns (summed NLL, the positions scored, the context each had)."""
    w = min(window, positions)
    s = min(stride, w - 1)
    total, scored, context, prev_end = 0.0, [], [], 0
    with torch.no_grad():
        for begin in range(0, len(ids), s):
            end = min(begin + w, len(ids))
            logits = hf(torch.tensor([ids[begin:end]])).logits[0].double()  # row r predicts token begin + r + 1
            for t in range(max(prev_end, 1), end):
                total -= torch.log_softmax(logits[t - begin - 1], -1)[ids[t]].item()
                scored.append(t)
                context.append(t - begin)
            prev_end = end
            if end == len(ids):
                break
    return total, scored, context


def test_windows_score_every_token_once_with_context():
    """The plan alone, over text lengths around the window edges: strides at, past and far past the window,
    windows past the model's positions."""
    from models.perplexity import window_and_stride, windows

    for positions in (2, 3, 16, 17, 512):
        for window in (2, 3, 8, 16, 17, 1024):
            for stride in (1, 2, 7, 8, 15, 16, 17, 512):
                w, s = window_and_stride(window, stride, positions)
                assert w == min(window, positions) and s == min(stride, w - 1)
                for n in (2, 3, 15, 16, 17, 33, 100):
                    plan = list(windows(n, w, s))
                    scored = [t for b, e, first in plan for t in range(first, e)]
                    assert scored == list(range(1, n)), (positions, window, stride, n)
                    assert all(0 <= b < first < e <= n and e - b <= w for b, e, first in plan)
                    assert all(plan[i].begin == i * s for i in range(len(plan)))  # the recipe's window starts
    for bad in ((1, 1, None), (8, 0, None), (1024, 512, 1)):
        with pytest.raises(ValueError):
            window_and_stride(*bad)


@pytest.mark.parametrize("positions, window, stride", [
    (512, 1024, 512),  # the report: window capped to 512, stride 512 -> 511
    (512, 512, 512),  # window == stride as given
    (384, 1024, 512),  # positions below the stride: window 384, stride 383
    (512, 256, 512),  # window below the stride given: stride 255
])
def test_perplexity_at_or_past_the_stride_equals_the_recipe(short_context_qwen2, positions, window, stride):
    """Our NLL over every token but the first, counted once each, against HF transformers on the same
    checkpoint and the same windows."""
    from transformers import AutoModelForCausalLM

    from models.perplexity import negative_log_likelihood

    path = short_context_qwen2[positions]
    ids = load_tokenizer(path)(LONG_TEXT)["input_ids"]
    assert len(ids) > 3 * min(window, positions)  # several windows
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    assert hf.config.max_position_embeddings == positions
    ref_total, scored, context = reference_nll(hf, ids, window, stride, positions)
    assert sorted(scored) == list(range(1, len(ids))) and min(context) >= 1
    ours = load_model(path, torch.float32)
    assert ours.config.max_position_embeddings == positions
    total, count = negative_log_likelihood(ours, ids, window, stride)
    assert count == len(ids) - 1
    assert total == pytest.approx(ref_total, rel=1e-4)
    assert perplexity(ours, ids, window, stride) == pytest.approx(math.exp(ref_total / (len(ids) - 1)), rel=1e-4)


def test_eval_cli_on_models_no_longer_than_the_stride(short_context_qwen2, tmp_path, capsys, monkeypatch):
    """`attnserve eval` with the default window 1024 / stride 512 on 512- and 384-position models, and
    `--window 256 --stride 512`: exit 0, finite perplexities, the paged path's equal to the dense one."""
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "long.txt"
    text.write_text(LONG_TEXT)
    models = ["--model", str(short_context_qwen2[512]), "--model", str(short_context_qwen2[384])]
    for extra in ([], ["--window", "256", "--stride", "512"]):
        out = tmp_path / "eval.json"
        assert main(["eval", "--text", str(text), "--dtype", "float32", *extra, *models, "--json", str(out)]) == 0
        rows = json.loads(out.read_text())
        assert len(rows) == 2 and all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows)
        window, stride = (int(extra[1]), int(extra[3])) if extra else (1024, 512)
        for r, positions in zip(rows, (512, 384)):
            path = short_context_qwen2[positions]
            ids = load_tokenizer(path)(LONG_TEXT)["input_ids"]
            dense = perplexity(load_model(path, torch.float32), ids, window, stride)
            assert r["perplexity"] == pytest.approx(dense, rel=1e-5)
    err = capsys.readouterr().err
    assert "window 512, stride 511" in err and "window 384, stride 383" in err and "window 256, stride 255" in err
    assert main(["eval", "--text", str(text), "--window", "1", *models]) == 2  # no token would have context
