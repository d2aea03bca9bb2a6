"""KV-head conversion: expansion is exact, mean-pooling loads in transformers and matches us."""
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from models import load_model, load_tokenizer, resolve_model
from models.kv_heads import convert, kv_sources
from tests.reference import dense_greedy, hf_greedy, load_hf

PROMPT = "The capital of France is"


def logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def test_kv_sources_groups():
    assert kv_sources(9, 3, 9) == [Counter({j // 3: 1}) for j in range(9)]  # expand: copy
    assert kv_sources(9, 3, 1) == [Counter({0: 3, 1: 3, 2: 3})]  # shrink to MQA: mean of 3
    assert kv_sources(4, 4, 2) == [Counter({0: 1, 1: 1}), Counter({2: 1, 3: 1})]  # MHA -> GQA pairs
    with pytest.raises(ValueError, match="multiple"):
        kv_sources(9, 3, 2)


@pytest.mark.parametrize("arch,kv_from,kv_to", [("llama", 2, 4), ("qwen2", 2, 4), ("gpt_bigcode", 1, 4), ("mistral", 1, 4)])
def test_expansion_is_identical(arch, kv_from, kv_to, tiny_checkpoints, tmp_path):
    src = tiny_checkpoints[arch]
    out = convert(src, kv_to, tmp_path / "mha", progress=False)
    a, b = load_model(src), load_model(out)
    assert (a.config.num_kv_heads, b.config.num_kv_heads) == (kv_from, kv_to)
    ids = load_tokenizer(out)(PROMPT)["input_ids"]
    assert (logits(a, ids) - logits(b, ids)).abs().max() <= 1e-5
    assert dense_greedy(b, ids, 32) == dense_greedy(a, ids, 32)
    assert dense_greedy(b, ids, 8) == hf_greedy(load_hf(out), ids, 8)  # transformers reads it too


@pytest.mark.parametrize("arch,kv_to", [("llama", 1), ("qwen2", 1), ("gpt_bigcode", 1)])
def test_pooled_model_loads_in_transformers_and_matches_us(arch, kv_to, tiny_checkpoints, tmp_path):
    src = tiny_checkpoints[arch]
    if arch == "gpt_bigcode":  # MHA -> MQA: start from an expanded copy
        src = convert(src, 4, tmp_path / "mha", progress=False)
    out = convert(src, kv_to, tmp_path / "pooled", progress=False)
    ours, hf = load_model(out), load_hf(out)
    assert ours.config.num_kv_heads == kv_to
    ids = load_tokenizer(out)(PROMPT)["input_ids"]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    assert (logits(ours, ids) - expected).abs().max() <= 1e-4
    assert dense_greedy(ours, ids, 16) == hf_greedy(hf, ids, 16)
    source_diff = (logits(load_model(tiny_checkpoints[arch]), ids) - expected).abs().max()
    if arch == "gpt_bigcode":  # MQA -> MHA -> MQA pools identical copies: the original comes back
        assert source_diff <= 1e-5
    else:  # pooling distinct heads is an approximation: the model changes
        assert source_diff > 1e-3


def test_pooled_heads_are_group_means(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file

    out = convert(tiny_checkpoints["qwen2"], 1, tmp_path / "mqa", progress=False)
    src = load_model(tiny_checkpoints["qwen2"])
    new = load_file(out / "model.safetensors")
    k_src = src.layers[0].attn.qkv_proj.weight[64:96].reshape(2, 16, 64)  # 2 kv heads of 16 dims
    assert torch.allclose(new["model.layers.0.self_attn.k_proj.weight"], k_src.mean(0), atol=1e-6)
    b_src = src.layers[0].attn.qkv_proj.bias[64:96].reshape(2, 16)
    assert torch.allclose(new["model.layers.0.self_attn.k_proj.bias"], b_src.mean(0), atol=1e-6)


def test_gpt2_conversion_is_refused(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="gpt2 has no kv-head setting"):
        convert(tiny_checkpoints["gpt2"], 1, tmp_path / "x", progress=False)


def test_cli_convert_writes_checkpoint_with_progress(tiny_checkpoints, tmp_path):
    out = tmp_path / "cli-mqa"
    exe = os.path.join(os.path.dirname(sys.executable), "attnserve")
    res = subprocess.run([exe, "convert", "--model", str(tiny_checkpoints["llama"]), "--kv-heads", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "kv heads 2 -> 1" in res.stderr
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    bad = subprocess.run([exe, "convert", "--model", str(tiny_checkpoints["llama"]), "--kv-heads", "3", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "must be a multiple" in bad.stderr


def test_default_model_mha_and_mqa_forms(default_model_dir):
    gqa, mha_dir, mqa_dir = default_model_dir, resolve_model("smollm2-135m-instruct-mha"), resolve_model("smollm2-135m-instruct-mqa")
    assert json.loads((mha_dir / "config.json").read_text())["num_key_value_heads"] == 9
    assert json.loads((mqa_dir / "config.json").read_text())["num_key_value_heads"] == 1
    tok = load_tokenizer(mha_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    a, b = load_model(gqa), load_model(mha_dir)
    assert dense_greedy(b, ids, 12) == dense_greedy(a, ids, 12)
    mqa = load_model(mqa_dir)
    assert mqa.config.attention_kind == "mqa"
    assert dense_greedy(mqa, ids, 8) == hf_greedy(load_hf(mqa_dir), ids, 8)
