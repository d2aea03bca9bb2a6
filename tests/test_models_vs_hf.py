"""Our DecoderLM against HF transformers on the same checkpoints: logits and greedy tokens."""
import pytest
import torch

from models import load_model, load_tokenizer
from models.attention import DenseAttention
from models.config import RopeConfig
from models.rope import rope_inv_freq
from tests.reference import dense_greedy, hf_greedy, load_hf
from tests.tiny import ARCHS

pytestmark = pytest.mark.isa  # make test-isa runs this file again under the AVX2 cap

PROMPTS = ["The capital of France is", "Beautiful is better than ugly. Explicit is",
           "0 1 2 3", "Keys and values are cached in blocks of sixteen tokens; queries attend to every"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf_on_a_packed_batch(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    ours, hf, tok = load_model(path), load_hf(path), load_tokenizer(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    lens = tuple(len(p) for p in prompts)
    assert len(set(lens)) > 1
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, positions, DenseAttention(lens)))  # (T, V)
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max() <= 1e-4
    assert logits.std() > 0.1  # a real signal, not all-equal logits


@pytest.mark.parametrize("arch", ARCHS)
def test_32_greedy_tokens_match_hf(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    ours, hf, tok = load_model(path), load_hf(path), load_tokenizer(path)
    for prompt in PROMPTS[:2]:
        ids = tok(prompt)["input_ids"]
        expected = hf_greedy(hf, ids, 32)
        assert dense_greedy(ours, ids, 32) == expected
        assert len(set(expected)) > 1


def test_reference_attention_model_equals_sdpa_model(tiny_checkpoints):
    model = load_model(tiny_checkpoints["qwen2"])
    ids = torch.arange(20) % 50
    with torch.no_grad():
        fast = model(ids, torch.arange(20), DenseAttention((20,), "sdpa"))
        ref = model(ids, torch.arange(20), DenseAttention((20,), "reference"))
    assert (fast - ref).abs().max() <= 1e-5


def test_bfloat16_load_tracks_float32(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    fp32, bf16 = load_model(path, "float32"), load_model(path, "bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.lm_head.weight is bf16.embed.weight
    ids = torch.arange(12) + 5
    with torch.no_grad():
        a = fp32.compute_logits(fp32(ids, torch.arange(12)))
        b = bf16.compute_logits(bf16(ids, torch.arange(12)))
    assert b.dtype == torch.float32
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.99


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
])
def test_rope_frequencies_match_hf(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=params)
    kind = params["rope_type"]
    fn = ROPE_INIT_FUNCTIONS[kind] if kind != "default" else None
    expected = fn(hf_cfg, "cpu")[0] if fn else 1.0 / (params["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
    ours = rope_inv_freq(128, RopeConfig.from_hf(params))
    assert torch.allclose(ours, expected, rtol=1e-6, atol=0)
