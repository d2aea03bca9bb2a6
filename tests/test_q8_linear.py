"""The 8-bit-activation linear (models/csrc/q8_linear.cpp) for the ISA level this process runs at (make
test-isa runs it under the AVX2 cap and on the portable build too): what it computes (x rounded to int8
per block, times the exact weights), its error against the exact product within the analytic bound,
batch invariance bit for bit, and the modules built on it."""
import pytest
import torch
import torch.nn.functional as F

from models.native.libraries import load
from models.quant_formats import quantize_rtn
from models.quant_linear import QuantEmbedding, QuantLinear
from tests.test_quant_linear import assert_rows_alone, random_quantized

pytestmark = [pytest.mark.kernel, pytest.mark.tiles]  # make test-isa runs this file again under the AVX2 cap, on the portable build and on emulated AMX tiles

ROWS = [1, 7, 32, 300]  # decode, speculative verification, a prefill chunk
# (bits, group, scale storage, offsets) as each format reaches the kernel (models/quant_formats.py)
FORMATS = {
    "Q4_0": (4, 32, "fp16", True), "Q4_1": (4, 32, "fp16", True), "Q4_K": (4, 32, "fp32", True),
    "Q8_0": (8, 32, "fp16", False), "Q5_0": (8, 32, "fp16", True), "Q5_1": (8, 32, "fp16", True),
    "Q5_K": (8, 32, "fp32", True), "Q6_K": (8, 16, "fp32", False),
    "int8": (8, 1152, "fp32", False), "int4_g32": (4, 32, "fp32", True), "int4_g128": (4, 128, "fp32", True),
}


def act_block(group: int) -> int:
    return 32 if group % 32 == 0 else group


def rounded_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) rounded as the kernel rounds it: per block, scale = max |x| / 127 and
    q = round(x * (127 / max |x|)) (half to even, fp32): returns (q * scale, scale per element)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)  # (M, K / B, B)
    amax = xb.abs().amax(dim=-1, keepdim=True)  # (M, K / B, 1)
    # NOTE: a tensor divided by a tensor: torch's `127 / amax` multiplies by a reciprocal, one rounding more
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    q = torch.round((xb * inv).clamp(-127, 127))
    scale = amax / 127
    return (q.double() * scale.double()).reshape(m, k), scale.expand_as(xb).reshape(m, k).double()


def packed(w):
    load("q8_linear")
    return torch.ops.attnserve.pack_q8(w.q, w.scale, w.offset, w.bits, w.group_size)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", ROWS)
def test_equals_rounded_activations_times_exact_weights(fmt, m):
    bits, group, scales, offsets = FORMATS[fmt]
    n, k = 100, 1152  # 100 features: not a multiple of a panel pair at any width
    w = random_quantized(n, k, bits, group, scales, offsets, seed=m + bits + group)
    codes, packed_scales, packed_offsets = packed(w)
    assert packed_scales.dtype == (torch.float16 if scales == "fp16" else torch.float32)
    g = torch.Generator().manual_seed(m)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    y = torch.ops.attnserve.q8_linear(x, codes, packed_scales, packed_offsets, b, bits, group, n)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    dense = w.dequantize().double()
    xq, _ = rounded_activations(x, act_block(group))
    expected = F.linear(xq, dense, b.double())
    # NOTE: the integer sums are exact; what is left is fp32 scaling and summing over blocks
    assert (y.double() - expected).abs().max() <= 1e-5 * F.linear(xq.abs(), dense.abs()).max()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bf16_rows_are_read_as_their_fp32_widening(fmt):
    """bf16 x is quantized as it is, not through an fp32 copy: the same bits as its exact fp32 widening."""
    bits, group, scales, offsets = FORMATS[fmt]
    n, k = 100, 1152
    codes, packed_scales, packed_offsets = packed(random_quantized(n, k, bits, group, scales, offsets, seed=3))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = torch.ops.attnserve.q8_linear(x, codes, packed_scales, packed_offsets, None, bits, group, n)
    wide = torch.ops.attnserve.q8_linear(x.float(), codes, packed_scales, packed_offsets, None, bits, group, n)
    assert y.dtype == torch.bfloat16 and torch.equal(y, wide.bfloat16())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K", "int4_g128"])
def test_error_against_exact_activations_is_within_the_rounding_bound(fmt):
    """|y - x W^T| <= sum_k scale(k) / 2 * |w_k| (each x rounded by at most half its block's step),
    and the bound is not loose: the error reaches a fair share of it."""
    bits, group, scales, offsets = FORMATS[fmt]
    w = random_quantized(64, 1152, bits, group, scales, offsets, seed=11)
    codes, packed_scales, packed_offsets = packed(w)
    x = torch.randn(32, 1152) * torch.linspace(0.1, 3, 1152)  # blocks of different ranges
    y = torch.ops.attnserve.q8_linear(x, codes, packed_scales, packed_offsets, None, bits, group, 64)
    dense = w.dequantize().double()
    exact = F.linear(x.double(), dense)
    _, step = rounded_activations(x, act_block(group))
    bound = F.linear(step / 2, dense.abs())  # (M, N)
    fp32 = 1e-5 * F.linear(x.double().abs(), dense.abs())
    err = (y.double() - exact).abs()
    assert (err <= bound + fp32).all()
    assert err.max() > 0.05 * bound.max()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K", "int4_g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_whatever_the_rows_beside_it(fmt, dtype):
    bits, group, scales, offsets = FORMATS[fmt]
    layer = QuantLinear(random_quantized(100, 1152, bits, group, scales, offsets, seed=5), torch.randn(100), dtype,
                        activations="int8")
    assert layer.int8_activations
    assert_rows_alone(layer, dtype)


def test_module_switch_and_what_falls_back():
    full = torch.randn(96, 128) * 0.05
    w = quantize_rtn(full, "int4_g32")
    exact, int8 = QuantLinear(w, None, torch.float32), QuantLinear(w, None, torch.float32, activations="int8")
    assert not exact.int8_activations and int8.int8_activations and "int8 activations" in repr(int8)
    x = torch.randn(5, 128)
    assert (exact(x) - F.linear(x, w.dequantize())).abs().max() < 1e-5  # the exact path is unchanged
    assert 0 < (int8(x) - exact(x)).abs().max() < 0.05 * exact(x).abs().max()
    odd = random_quantized(16, 48, 8, 48, seed=1)  # groups of 48: not whole blocks of 32
    assert not QuantLinear(odd, None, torch.float32, activations="int8").int8_activations
    with pytest.raises(ValueError, match="activations"):
        QuantLinear(w, None, torch.float32, activations="fp8")


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K"])
def test_tied_embedding_reads_the_int8_packed_head(fmt):
    bits, group, scales, offsets = FORMATS[fmt]
    w = random_quantized(100, 1152, bits, group, scales, offsets, seed=bits + group)
    head = QuantLinear(w, None, torch.float32, activations="int8")
    table = QuantEmbedding.tied(head, torch.float32)
    ids = torch.tensor([0, 1, 15, 16, 17, 63, 64, 99, 99, 5])
    assert torch.equal(table(ids), w.dequantize()[ids])
    bf16 = QuantEmbedding.tied(head, torch.bfloat16)  # ids of any shape; rounded once, from the fp32 rows
    assert torch.equal(bf16(ids.view(2, 5)), w.dequantize()[ids].to(torch.bfloat16).view(2, 5, 1152))
    with pytest.raises(RuntimeError, match="out of range"):
        table(torch.tensor([-1]))


def test_packing_rejects_groups_it_cannot_block():
    load("q8_linear")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.attnserve.pack_q8(torch.zeros(4, 96, dtype=torch.int8), torch.ones(4, 2), None, 4, 48)


# ---- prompt rows (`prompt_rows`): on the amx build, bf16 tiles; elsewhere the int8 kernel, as every row --------
def tiles_here() -> bool:
    """Whether this process's q8_linear build has the bf16 tiles (the amx level)."""
    return load("q8_linear") == "amx"


def bf16_weights(w) -> torch.Tensor:
    """The weights as the tiles take them: code * scale + offset rounded once to fp32 (an FMA), then to bf16."""
    scale = w.scale.double().repeat_interleave(w.group_size, 1)  # (N, K)
    offset = 0 if w.offset is None else w.offset.double().repeat_interleave(w.group_size, 1)
    return (w.q.double() * scale + offset).float().bfloat16().double()  # NOTE: exact in float64 before the fp32 rounding


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", ROWS)
def test_prompt_rows_are_bf16_rows_times_bf16_weights_summed_in_fp32(fmt, m):
    bits, group, scales, offsets = FORMATS[fmt]
    n, k = 100, 1152
    w = random_quantized(n, k, bits, group, scales, offsets, seed=m + bits + group)
    codes, packed_scales, packed_offsets = packed(w)
    g = torch.Generator().manual_seed(m)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    y = torch.ops.attnserve.q8_linear(x, codes, packed_scales, packed_offsets, b, bits, group, n,
                                      torch.ones(m, dtype=torch.bool))
    int8 = torch.ops.attnserve.q8_linear(x, codes, packed_scales, packed_offsets, b, bits, group, n)
    if not tiles_here():
        assert torch.equal(y, int8)
        return
    xb = x.bfloat16().double()
    expected = F.linear(xb, bf16_weights(w), b.double())
    assert (y.double() - expected).abs().max() <= 1e-5 * F.linear(xb.abs(), bf16_weights(w).abs()).max()
    assert not torch.equal(y, int8)  # another kernel than the int8 one


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K", "int4_g128"])
def test_prompt_rows_error_against_the_exact_product_is_within_bf16_rounding(fmt):
    """|y - x W^T| <= (2^-8 + 2^-18) sum_k |x_k w_k| (x and w each rounded to bf16: at most 2^-9 of itself), plus fp32
    sums, and the bound is not loose."""
    bits, group, scales, offsets = FORMATS[fmt]
    w = random_quantized(64, 1152, bits, group, scales, offsets, seed=11)
    codes, packed_scales, packed_offsets = packed(w)
    x = torch.randn(32, 1152) * torch.linspace(0.1, 3, 1152)
    y = torch.ops.attnserve.q8_linear(x, codes, packed_scales, packed_offsets, None, bits, group, 64,
                                      torch.ones(32, dtype=torch.bool))
    if not tiles_here():
        return  # the int8 rows' bound: test_error_against_exact_activations_is_within_the_rounding_bound
    dense = w.dequantize().double()
    magnitude = F.linear(x.double().abs(), dense.abs())  # (M, N)
    err = (y.double() - F.linear(x.double(), dense)).abs()
    assert (err <= (2 ** -8 + 2 ** -18 + 1e-5) * magnitude).all()  # 1e-5: fp32 sums
    assert err.max() > 0.01 * (2 ** -8 * magnitude).max()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K", "int4_g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_row_is_the_same_bits_whatever_the_rows_beside_it(fmt, dtype):
    """Each row takes its own kernel (prompt rows the tiles, the rest int8) and the same bits as alone, M = 1..64,
    in calls mixing both kinds."""
    bits, group, scales, offsets = FORMATS[fmt]
    w = random_quantized(100, 1152, bits, group, scales, offsets, seed=5)
    codes, packed_scales, packed_offsets = packed(w)
    g = torch.Generator().manual_seed(6)
    x, b = torch.randn(64, 1152, generator=g).to(dtype), torch.randn(100, generator=g)
    prompt = torch.rand(64, generator=g) < 0.5

    def call(rows, kinds):
        return torch.ops.attnserve.q8_linear(rows, codes, packed_scales, packed_offsets, b, bits, group, 100, kinds)

    alone = torch.cat([call(x[i:i + 1], prompt[i:i + 1]) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(call(x[:m], prompt[:m]), alone[:m]), m
    int8 = torch.cat([call(x[i:i + 1], None) for i in range(64)])
    assert torch.equal(alone[~prompt], int8[~prompt])
    assert torch.equal(alone[prompt], int8[prompt]) != tiles_here()


def test_prompt_rows_must_be_one_bool_per_row():
    w = random_quantized(16, 64, 4, 32, seed=1)
    codes, packed_scales, packed_offsets = packed(w)
    with pytest.raises(RuntimeError, match="prompt_rows"):
        torch.ops.attnserve.q8_linear(torch.randn(3, 64), codes, packed_scales, packed_offsets, None, 4, 32, 16,
                                      torch.ones(2, dtype=torch.bool))
