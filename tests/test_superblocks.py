"""GGUF types held in their files' bytes by the 8-bit-activation kernel: K-quant scales as the files store them
(models/csrc/group_scales.h, the superblock form), 5- and 6-bit codes in their own bits and IQ4's codes as 4-bit
indices into its table (models/csrc/code_planes.h). The same weights, bit for bit, as the 8-bit codes with fp32
per-group scales they replace; Q4_K, Q5_K, Q6_K, IQ4_XS and IQ4_NL in exactly their files' bytes. make test-isa runs this file under the AVX2 cap, on the portable build and on emulated
AMX tiles."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from models.native.libraries import load
from models.quant_formats import GGUFRows, RowStack, from_gguf
from models.quant_linear import TABLE_CODES, QuantEmbedding, QuantLinear, packed_bits
from tests.random_gguf import random_blocks
from tests.test_q8_linear import ROWS, act_block, rounded_activations
from tests.test_quant_linear import assert_rows_alone

pytestmark = [pytest.mark.kernel, pytest.mark.tiles]

TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.IQ4_XS]  # every type whose decoder gives superblocks
OWN = TYPES + [T.IQ4_NL]  # and IQ4_NL, its table codes with fp16 scales per 32
SIGNED = {T.Q6_K, T.Q3_K, T.IQ4_XS, T.IQ4_NL}  # d of either sign (their scales are signed too)
N, K = 100, 1024  # 100 features: not a multiple of a panel pair at any width


def raw(kind: T, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    return random_blocks(np.random.default_rng(seed), kind, n, k, signed=kind in SIGNED)  # (n, bytes per row)


def packs(w):
    """(its codes' width and per-group fp32/fp16 scales, the kernel's form: the file's widths and scales) of one
    decoded weight, as (codes, scales, offsets)."""
    load("q8_linear")
    generic = torch.ops.attnserve.pack_q8(w.q, w.scale, w.offset, w.bits, w.group_size)
    own = torch.ops.attnserve.pack_q8(w.q, w.scale, w.offset, packed_bits(w, True), w.group_size, w.superblocks)
    return generic, own


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("kind", OWN, ids=lambda t: t.name)
@pytest.mark.parametrize("m", ROWS)
def test_superblock_scales_give_the_reference_weights_bit_for_bit(kind, m):
    blocks = raw(kind, seed=m)
    w = from_gguf(blocks, kind, (N, K))
    generic, records = packs(w)
    if kind in TYPES:
        assert records[1].dtype == torch.uint8 and records[1].shape[1] == K // 256
    g = torch.Generator().manual_seed(m)
    x, b = torch.randn(m, K, generator=g), torch.randn(N, generator=g)
    bits = packed_bits(w, True)
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.ops.attnserve.q8_linear(x.to(dtype), *records, b, bits, w.group_size, N)
        assert torch.equal(y, torch.ops.attnserve.q8_linear(x.to(dtype), *generic, b, w.bits, w.group_size, N))
        prompt = torch.ones(m, dtype=torch.bool)  # the amx build's bf16 tiles dequantize from the records too
        assert torch.equal(torch.ops.attnserve.q8_linear(x.to(dtype), *records, b, bits, w.group_size, N, prompt),
                           torch.ops.attnserve.q8_linear(x.to(dtype), *generic, b, w.bits, w.group_size, N, prompt))
    # against gguf-py's own dequantization of the file's bytes: x rounded to int8 per block, times those weights
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(N, K)).double()
    xq, _ = rounded_activations(x, act_block(w.group_size))
    y = torch.ops.attnserve.q8_linear(x, *records, b, bits, w.group_size, N).double()
    assert (y - F.linear(xq, dense, b.double())).abs().max() <= 1e-5 * F.linear(xq.abs(), dense.abs()).max()


@pytest.mark.parametrize("kind", OWN, ids=lambda t: t.name)
def test_rows_read_out_of_the_records_are_the_dequantized_rows(kind):
    w = from_gguf(raw(kind, seed=3), kind, (N, K))
    _, records = packs(w)
    ids = torch.tensor([0, 1, 15, 16, 17, 63, 64, 99, 5])
    rows = torch.ops.attnserve.q8_rows(*records, ids, packed_bits(w, True), w.group_size, K, N)
    assert torch.equal(rows, w.dequantize()[ids])


def test_k_quants_are_held_in_their_files_bytes_and_the_8_bit_coded_types_in_fewer_than_before():
    n = 256  # whole quads of panels at every width: no padding
    sizes = {}
    for kind in OWN:
        w = from_gguf(raw(kind, n=n), kind, (n, K))
        generic, records = packs(w)
        sizes[kind] = nbytes(records)
        assert sizes[kind] < nbytes(generic)
    # 4.5, 5.5, 6.56, 4.25 and 4.5 bits a weight, where they took 6, 10, 10, 9 and 9
    for kind in (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.IQ4_NL):
        block, type_size = GGML_QUANT_SIZES[kind]
        assert sizes[kind] == n * K // block * type_size, kind.name


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_whatever_the_rows_beside_it(kind, dtype):
    layer = QuantLinear(GGUFRows(raw(kind, seed=5), kind, K), torch.randn(N), dtype, activations="int8")
    assert layer.int8_activations and layer.scales.dtype == torch.uint8
    assert_rows_alone(layer, dtype)


def test_modules_take_the_records_of_one_kind_and_a_mixed_stack_in_parts_of_one_kind():
    q, v = GGUFRows(raw(T.Q4_K, n=64, seed=1), T.Q4_K, K), GGUFRows(raw(T.Q6_K, n=32, seed=2), T.Q6_K, K)
    k = GGUFRows(raw(T.Q4_K, n=32, seed=3), T.Q4_K, K)
    one = QuantLinear(RowStack([q, k]), None, torch.float32, activations="int8")
    bias = torch.randn(128)
    mixed = QuantLinear(RowStack([q, k, v]), bias, torch.float32, activations="int8")  # Q4_K_M's q/k/v
    exact = QuantLinear(q, None, torch.float32)  # the exact kernel keeps per-group scales
    assert one.scales.dtype == torch.uint8 and one.parts is None and exact.scales.dtype == torch.float32
    # the runs q+k (Q4_K) and v (Q6_K), each in its file's bytes: no part widens to the generic form
    assert [(p.kind, p.out_features, p.bits, p.scales.dtype) for p in mixed.parts] == [
        ("Q4_K", 96, 4, torch.uint8), ("Q6_K", 32, 6, torch.uint8)]
    x = torch.randn(3, K)
    own = torch.cat([one(x), QuantLinear(v, None, torch.float32, activations="int8")(x)], -1) + bias
    assert torch.equal(mixed(x), own)
    whole = torch.cat([q.materialize().dequantize(), k.materialize().dequantize(), v.materialize().dequantize()])
    assert (mixed(x) - x @ whole.T - bias).abs().max() < 0.05 * (x @ whole.T).abs().max()
    head = QuantLinear(q, None, torch.float32, activations="int8")
    table = QuantEmbedding.tied(head, torch.float32)
    ids = torch.tensor([0, 7, 63])
    assert torch.equal(table(ids), q.materialize().dequantize()[ids])


def test_the_exact_kernel_refuses_superblock_records():
    w = from_gguf(raw(T.Q4_K), T.Q4_K, (N, K))
    _, records = packs(w)
    load("quant_linear")
    with pytest.raises(RuntimeError, match="superblock"):
        torch.ops.attnserve.quant_linear(torch.randn(1, K), *records, None, 4, 32, N)


def test_q5_1_codes_in_five_bits_give_the_eight_bit_codes_result():
    blocks = raw(T.Q5_1, seed=9)
    w = from_gguf(blocks, T.Q5_1, (N, K))
    generic, five = packs(w)
    assert packed_bits(w, True) == 5 and five[0].numel() * 8 == generic[0].numel() * 5  # codes: 5 bits, where 8
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(9))
    assert torch.equal(torch.ops.attnserve.q8_linear(x, *five, None, 5, 32, N),
                       torch.ops.attnserve.q8_linear(x, *generic, None, 8, 32, N))
    ids = torch.tensor([0, 50, 99])
    assert torch.equal(torch.ops.attnserve.q8_rows(*five, ids, 5, 32, K, N), w.dequantize()[ids])


def test_codes_out_of_their_width_are_refused():
    load("q8_linear")
    q = torch.full((4, 256), 40, dtype=torch.int8)  # 6-bit codes are -32..31
    with pytest.raises(RuntimeError, match="6-bit codes must be in -32..31"):
        torch.ops.attnserve.pack_q8(q, torch.ones(4, 16), None, 6, 16)


def test_values_off_the_table_are_refused():
    load("q8_linear")
    q = torch.full((4, 256), 2, dtype=torch.int8)  # IQ4's values are -127, -104, ..., 1, 13, ...: not 2
    with pytest.raises(RuntimeError, match="table codes must be IQ4_NL's values"):
        torch.ops.attnserve.pack_q8(q, torch.ones(4, 8), None, TABLE_CODES, 32)
