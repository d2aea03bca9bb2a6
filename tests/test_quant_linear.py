"""The quantized-linear kernel (codes + group scales/offsets, models/csrc/quant_linear.cpp) against
float64 on the dequantized weights, for the ISA level this process runs at (CI runs this file
under ATTNSERVE_CPU_ISA=avx2 and generic too), and the modules built on it."""
import pytest
import torch
import torch.nn.functional as F

from models.native.libraries import load
from models.quant_formats import QuantizedTensor, quantize_rtn
from models.quant_linear import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.kernel  # make test-isa runs this file again under the AVX2 cap and on the portable build

ROWS = [1, 2, 3, 7, 32, 300]  # decode (code tiles), the crossover, prefill (widened panels)


def random_quantized(n, k, bits, group, scales="fp32", offsets=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.02
    offset = torch.randn(n, k // group, generator=g) * 0.02 if offsets else None
    if scales == "fp16":  # a GGUF's Q4_0 / Q4_1 / Q8_0: the kernel keeps them as fp16
        scale = scale.half().float()
        offset = None if offset is None else offset.half().float()
    return QuantizedTensor(q, scale, offset, bits, group, "test")


# (bits, group, scale storage, offsets): every format the kernel dispatches on
FORMATS = [(4, 32, "fp16", True), (4, 32, "fp32", True), (4, 128, "fp32", True), (4, 64, "fp16", False),
           (8, 32, "fp16", False), (8, 16, "fp32", False), (8, 32, "fp32", True), (8, 576, "fp32", False)]


@pytest.mark.parametrize("bits,group,scales,offsets", FORMATS)
@pytest.mark.parametrize("m", ROWS)
def test_matches_dequantized_weights_in_float64(bits, group, scales, offsets, m):
    load("quant_linear")
    n, k = 100, 1152  # 100 features: not a multiple of a panel pair at any width; K: every group divides it
    w = random_quantized(n, k, bits, group, scales, offsets, seed=m + bits)
    codes, packed_scales, packed_offsets = torch.ops.attnserve.pack_quant(w.q, w.scale, w.offset, bits, group)
    assert packed_scales.dtype == (torch.float16 if scales == "fp16" else torch.float32)
    assert (packed_offsets.numel() > 0) == offsets
    g = torch.Generator().manual_seed(m)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    y = torch.ops.attnserve.quant_linear(x, codes, packed_scales, packed_offsets, b, bits, group, n)
    expected = F.linear(x.double(), w.dequantize().double(), b.double())
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # NOTE: fp32 sums in another order (per group, then scaled): relative to the outputs' size
    assert (y.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("m", [1, 7, 300])
def test_bf16_inputs_give_bf16_outputs(m):
    """Every row count: exact weights, fp32 sums, one bf16 rounding of the output."""
    w = random_quantized(64, 256, 4, 32, seed=3)
    layer = QuantLinear(w, None, torch.bfloat16)
    x = torch.randn(2, m, 256).bfloat16()  # (B, S, K): leading dims kept
    y = layer(x)
    expected = F.linear(x.double(), w.dequantize().double())
    assert y.dtype == torch.bfloat16 and y.shape == (2, m, 64)
    assert ((y.double() - expected).abs() <= 2 ** -8 * expected.abs() + 1e-5).all()


@pytest.mark.parametrize("bits,group,scales,offsets", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_is_the_same_bits_whatever_the_rows_beside_it(bits, group, scales, offsets, dtype):
    """Batch invariance: row i of a call with M = 1..64 rows (code tiles up to 8, widened panels above)
    equals, bit for bit, the row computed alone."""
    layer = QuantLinear(random_quantized(100, 1152, bits, group, scales, offsets, seed=5), torch.randn(100), dtype)
    assert layer.mode == "packed" and not layer.int8_activations
    assert_rows_alone(layer, dtype)


def assert_rows_alone(layer, dtype, rows: int = 64) -> None:
    """Row i of a call with M = 1..rows rows equals, bit for bit, the row computed alone."""
    x = torch.randn(rows, layer.in_features).to(dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    for m in range(1, rows + 1):
        assert torch.equal(layer(x[:m]), alone[:m]), m


def test_every_row_count_and_an_empty_batch():
    w = random_quantized(70, 64, 8, 32, seed=4)
    layer = QuantLinear(w, None, torch.float32)
    assert layer.mode == "packed"
    assert layer(torch.randn(0, 64)).shape == (0, 70)
    for m in range(1, 41):
        x = torch.randn(m, 64)
        expected = x.double() @ w.dequantize().double().T
        assert (layer(x).double() - expected).abs().max() < 1e-5 * expected.abs().max(), m


def test_rtn_int4_layer_equals_its_dequantized_weights():
    full = torch.randn(96, 128) * 0.05
    w = quantize_rtn(full, "int4_g128")
    x = torch.randn(5, 128)
    y = QuantLinear(w, torch.zeros(96), torch.float32)(x)
    assert (y - F.linear(x, w.dequantize())).abs().max() < 1e-5
    assert (y - F.linear(x, full)).abs().max() > 1e-4  # and really quantized


def test_packing_rejects_codes_out_of_range_and_ragged_groups():
    load("quant_linear")
    with pytest.raises(RuntimeError, match="0..15"):
        torch.ops.attnserve.pack_quant(torch.full((4, 32), 16, dtype=torch.int8), torch.ones(4, 1), None, 4, 32)
    with pytest.raises(RuntimeError, match="multiple of the group"):
        torch.ops.attnserve.pack_quant(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 1), None, 8, 32)
    codes, scales, offsets = torch.ops.attnserve.pack_quant(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2),
                                                            None, 8, 32)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.attnserve.quant_linear(torch.zeros(1, 32), codes, scales, offsets, None, 8, 32, 4)


def test_embedding_gathers_dequantized_rows():
    w = random_quantized(50, 64, 8, 16, offsets=False, seed=5)
    table = QuantEmbedding(w, torch.float32)
    ids = torch.tensor([0, 49, 7, 7])
    assert torch.equal(table(ids), w.dequantize()[ids])
    assert table.weight.dtype == torch.float32


@pytest.mark.parametrize("bits,group,scales,offsets", FORMATS)
def test_tied_embedding_reads_the_packed_head(bits, group, scales, offsets):
    """A tied table held once: rows gathered out of the LM head's panels equal the table's, exactly,
    for every format (row ids in every lane of a panel, the last panel included)."""
    w = random_quantized(100, 1152, bits, group, scales, offsets, seed=bits + group)
    head = QuantLinear(w, None, torch.float32)
    table = QuantEmbedding.tied(head, torch.float32)
    ids = torch.tensor([0, 1, 15, 16, 17, 63, 64, 99, 99, 5])
    assert torch.equal(table(ids), w.dequantize()[ids])
    bf16 = QuantEmbedding.tied(head, torch.bfloat16)  # ids of any shape; rounded once, from the fp32 rows
    assert torch.equal(bf16(ids.view(2, 5)), w.dequantize()[ids].to(torch.bfloat16).view(2, 5, 1152))
    with pytest.raises(RuntimeError, match="out of range"):
        table(torch.tensor([3, 100]))
    assert table.codes.data_ptr() == head.codes.data_ptr()  # the head's storage, not a copy
    assert table.weight.dtype == torch.float32 and table.embedding_dim == 1152 and table.num_embeddings == 100


def _mapping_flags(address: int) -> list[str] | None:
    """VmFlags of the mapping holding `address` (/proc/self/smaps); "hg" is MADV_HUGEPAGE."""
    flags, inside = None, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif line.startswith("VmFlags:") and inside:
            flags = line.split()[1:]
    return flags


@pytest.mark.parametrize("rows", [100, 1000])
def test_packed_tensors_are_packed_by_rows_into_huge_pages(rows, monkeypatch):
    """Packing a chunk of rows at a time (as the loader reads a GGUF matrix) gives pack's tensors exactly, in
    mappings that asked the kernel for transparent huge pages; a tied table reads the head's own."""
    import models.quant_linear as ql

    monkeypatch.setattr(ql, "PACK_WEIGHTS", 256 * 1152)  # 1000 rows: four chunks, the last partial
    w = random_quantized(rows, 1152, 4, 32, "fp16", True, seed=9)
    head = QuantLinear(w, torch.randn(rows), torch.float32, activations="int8")
    table = QuantEmbedding.tied(head, torch.float32)
    whole = torch.ops.attnserve.pack_q8(w.q, w.scale, w.offset, 4, 32)
    for got, want in zip((head.codes, head.scales, head.offsets), whole):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert "hg" in (_mapping_flags(got.data_ptr()) or [])
    assert table.codes is head.codes and table.scales is head.scales  # the head's storage, not a copy
    ids = torch.tensor([0, 17, rows - 1])
    assert torch.equal(table(ids), w.dequantize()[ids])


def test_without_the_kernel_weights_are_dequantized_once(monkeypatch):
    """No compiler: the layer keeps the dequantized matrix and answers the same."""
    import models.quant_linear as ql

    w = random_quantized(40, 64, 4, 32, seed=6)
    monkeypatch.setattr(ql, "available", lambda name: False)
    layer = QuantLinear(w, None, torch.float32)
    assert layer.mode == "dense" and torch.equal(layer.weight, w.dequantize())
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x), F.linear(x, w.dequantize()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch's int4 tinygemm kernel")
@pytest.mark.parametrize("group,offsets", [(32, True), (128, True), (32, False)])
def test_cuda_int4_tinygemm_matches_the_dequantized_weights(group, offsets):
    w = random_quantized(256, 512, 4, group, "fp16", offsets, seed=7)
    layer = QuantLinear(w, torch.randn(256), torch.bfloat16, "cuda")
    assert layer.mode == "tinygemm"
    for m in (1, 7, 32, 300):
        x = torch.randn(m, 512, device="cuda").bfloat16()
        expected = F.linear(x.double(), w.dequantize().cuda().double(), layer.bias.double())
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 256)
        # bf16 scales and zeros, bf16 output: relative to the outputs' size
        assert (y.double() - expected).abs().max() <= 2e-2 * expected.abs().max(), m
