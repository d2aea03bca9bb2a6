"""Attention weights for heatmaps against transformers' own (eager attention, output_attentions)."""
import pytest
import torch

from models import load_model, load_tokenizer
from models.attention_maps import attention_weights
from tests.reference import load_hf

PROMPT = "Keys and values are cached in blocks of sixteen tokens; queries attend to every one"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gpt_bigcode"])  # GQA, GQA + bias, MHA, MQA
def test_weights_equal_transformers_eager(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    ids = load_tokenizer(path)(PROMPT)["input_ids"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), output_attentions=True).attentions  # per layer (1, H, T, T)
    ours = attention_weights(load_model(path, torch.float32), ids)
    assert sorted(ours) == list(range(len(expected)))
    t = len(ids)
    for layer, w in ours.items():
        assert w.shape == expected[layer].shape[1:] == (hf.config.num_attention_heads, t, t)
        assert (w - expected[layer][0]).abs().max() <= 1e-4, layer
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-5)
        assert (w.triu(diagonal=1) == 0).all()  # nothing above the diagonal, exactly
    assert max(w.std().item() for w in ours.values()) > 0.01  # not uniform attention everywhere


def test_chosen_layers_and_bad_indices(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    model = load_model(path, torch.float32)
    assert sorted(attention_weights(model, [5, 6, 7], layers=[1])) == [1]
    with pytest.raises(ValueError, match="out of range"):
        attention_weights(model, [5, 6], layers=[model.config.num_layers])
    with pytest.raises(ValueError, match="no tokens"):
        attention_weights(model, [])
    from models import attention_maps

    big = int((attention_maps.MAX_WEIGHTS / (model.config.num_layers * model.config.num_heads)) ** 0.5) + 1
    with pytest.raises(ValueError, match="fewer layers or a shorter prompt"):
        attention_weights(model, [5] * big)
