"""The attention layer: the seeds' worked numbers, masks, GQA/MQA, SDPA vs the written-out formula."""
import pytest
import torch

from models.attention import CausalSelfAttention, DenseAttention, causal_mask, reference_attention
from models.config import ModelConfig

SEED_Q = torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]])
SEED_V = torch.tensor([[1.0, 2], [3, 4], [5, 6]])


def cfg(heads=4, kv_heads=4, hidden=64, bias=False) -> ModelConfig:
    return ModelConfig(architecture="llama", num_layers=1, hidden_size=hidden, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=128,
                       vocab_size=32, max_position_embeddings=64, qkv_bias=bias, o_bias=bias)


def test_seed_numbers_full_attention():
    out, weights = reference_attention(SEED_Q, SEED_Q, SEED_V, causal=False)
    assert weights[0].tolist() == pytest.approx([0.506, 0.186, 0.307], abs=1e-3)
    assert out[0].tolist() == pytest.approx([2.60, 3.60], abs=1e-2)
    assert torch.allclose(weights.sum(-1), torch.ones(3))


def test_seed_numbers_causal_weights_above_diagonal_are_zero():
    _, weights = reference_attention(SEED_Q, SEED_Q, SEED_V, causal=True)
    assert (weights.triu(diagonal=1) == 0).all()
    assert weights[0].tolist() == [1.0, 0.0, 0.0]
    # row 1 sees keys 0 and 1 only: scores 0 and 1 (/2) -> softmax([0, 1])
    assert weights[1, :2].tolist() == pytest.approx(torch.softmax(torch.tensor([0.0, 1.0]), 0).tolist())


def test_causal_mask_is_bottom_right_aligned():
    m = causal_mask(2, 5)  # 2 new queries after 3 cached keys
    assert torch.isinf(m).tolist() == [[False, False, False, False, True], [False] * 5]
    assert (causal_mask(3, 3) == torch.full((3, 3), float("-inf")).triu(1)).all()


@pytest.mark.parametrize("bias", [False, True])
def test_mha_block_has_4_d_squared_weights(bias):
    d = 64
    attn = CausalSelfAttention(cfg(heads=4, kv_heads=4, hidden=d, bias=bias), 0)
    weights = sum(p.numel() for n, p in attn.named_parameters() if n.endswith("weight"))
    biases = sum(p.numel() for n, p in attn.named_parameters() if n.endswith("bias"))
    assert weights == 4 * d * d
    assert biases == (4 * d if bias else 0)


@pytest.mark.parametrize("kv_heads,kind", [(4, "mha"), (2, "gqa"), (1, "mqa")])
def test_kv_heads_shrink_only_kv_projections(kv_heads, kind):
    c = cfg(heads=4, kv_heads=kv_heads)
    attn = CausalSelfAttention(c, 0)
    assert c.attention_kind == kind
    assert attn.qkv_proj.weight.shape == ((4 + 2 * kv_heads) * 16, 64)
    assert c.kv_bytes_per_token(2) == 2 * 1 * kv_heads * 16 * 2


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_equals_reference(kv_heads):
    g = torch.Generator().manual_seed(1)
    lens = (5, 11, 1, 7)
    q = torch.randn(sum(lens), 4, 16, generator=g)
    k = torch.randn(sum(lens), kv_heads, 16, generator=g)
    v = torch.randn(sum(lens), kv_heads, 16, generator=g)
    fast = DenseAttention(lens, "sdpa")(0, q, k, v)
    ref = DenseAttention(lens, "reference")(0, q, k, v)
    assert fast.shape == (sum(lens), 4, 16)
    assert (fast - ref).abs().max() <= 1e-5


def test_packed_sequences_do_not_see_each_other():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(3))
    packed = DenseAttention((4, 5))(0, q, k, v)
    alone = DenseAttention((5,))(0, q[4:], k[4:], v[4:])
    assert torch.allclose(packed[4:], alone, atol=1e-6)


def test_sdpa_path_uses_flash_kernel_on_cpu():
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        DenseAttention((8,))(0, q[0].transpose(0, 1), k[0].transpose(0, 1), k[0].transpose(0, 1))
    names = {e.name for e in prof.events()}
    assert any("flash_attention" in n for n in names), names


def test_gqa_does_not_materialise_repeated_kv():
    q = torch.randn(1, 8, 6, 4)
    k = torch.randn(1, 2, 6, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        DenseAttention((6,))(0, q[0].transpose(0, 1), k[0].transpose(0, 1), k[0].transpose(0, 1))
    names = {e.name for e in prof.events()}
    assert not any("repeat_interleave" in n or n == "aten::repeat" for n in names)


def test_config_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cfg(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="supported: llama"):
        ModelConfig(architecture="t5", num_layers=1, hidden_size=8, num_heads=1, num_kv_heads=1, head_dim=8,
                    intermediate_size=8, vocab_size=8, max_position_embeddings=8)
