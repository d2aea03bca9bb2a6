"""models/quant_formats.py: GGUF blocks decode bit-exactly (vs gguf.quants), the common form stays lossless
through concat/select, and the RTN quantizers keep their error bounds."""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from models.quant_formats import SUPPORTED_GGUF_TYPES, QuantizedTensor, concat_rows, from_gguf, quantize_rtn
from tests.gguf_blocks import pack_blocks, random_blocks, random_fields

EXPECTED = {  # type -> (bits, group_size)
    T.Q8_0: (8, 32), T.Q4_0: (4, 32), T.Q4_1: (4, 32), T.Q5_0: (8, 32), T.Q5_1: (8, 32),
    T.Q4_K: (4, 32), T.Q5_K: (8, 32), T.Q6_K: (8, 16),
}
ZERO_POINT = {T.Q5_0: 16, T.Q6_K: 32}  # decoded code = stored code - zero point (signed, no offset)
TYPES = sorted(EXPECTED, key=lambda t: t.name)


def _shapes(t: T) -> list[tuple[int, int]]:
    block = GGML_QUANT_SIZES[t][0]
    return [(1, block), (3, 2 * block), (8, 3 * block)]  # the last has 24 blocks: every edge fp16 appears


def assert_same_bits(got: torch.Tensor, ref: np.ndarray | torch.Tensor, zero_sign: bool = True) -> None:
    """Equal float32 bit patterns; zero_sign=False lets +0.0 stand for -0.0."""
    ref = torch.as_tensor(np.ascontiguousarray(ref))
    assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape
    assert torch.isfinite(ref).all()  # a NaN would make the comparison vacuous
    if not zero_sign:
        got, ref = got + 0.0, ref + 0.0  # -0.0 -> +0.0; every other value unchanged
    diff = got.view(torch.int32) != ref.view(torch.int32)
    assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} differ: {got[diff][:4]} vs {ref[diff][:4]}"


# loaded in 8-bit codes, exactly (tests/gguf_blocks.py has no encoders for them: random bytes, valid scales)
EIGHT_BIT = {T.Q2_K: (8, 16), T.Q3_K: (8, 16), T.IQ4_NL: (8, 32), T.IQ4_XS: (8, 32)}


def test_supported_types():
    assert SUPPORTED_GGUF_TYPES == set(EXPECTED) | set(EIGHT_BIT)


@pytest.mark.parametrize("t", sorted(EIGHT_BIT, key=lambda t: t.name), ids=lambda t: t.name)
def test_low_bit_and_iq4_types_decode_exactly(t):
    from tests.random_gguf import random_blocks as random_bytes

    rng = np.random.default_rng(t.value)
    for n, k in _shapes(t):
        data = random_bytes(rng, t, n, k, signed=True)
        qt = from_gguf(data, t, (n, k))
        assert (qt.bits, qt.group_size, qt.kind, qt.shape) == (*EIGHT_BIT[t], t.name, (n, k))
        assert_same_bits(qt.dequantize(), gguf.quants.dequantize(data, t))


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "numpy"])
@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_decode_matches_reference_bit_for_bit(t, edge, native):
    """Both decoders: C++ (models/csrc/quant_linear.cpp gguf_codes, where the library builds) and numpy."""
    if native:
        from models.native.libraries import available

        assert available("quant_linear")
    rng = np.random.default_rng([t.value, edge])
    for n, k in _shapes(t):
        data = random_blocks(rng, t, n, k, edge)
        qt = from_gguf(data, t, (n, k), native=native)
        if not native:  # the same codes, scales and offsets, bit for bit, as the C++ decoder's
            cpp = from_gguf(data, t, (n, k))
            assert torch.equal(qt.q, cpp.q) and (qt.offset is None) == (cpp.offset is None)
            assert_same_bits(qt.scale, cpp.scale, zero_sign=True)
            if qt.offset is not None:
                assert_same_bits(qt.offset, cpp.offset, zero_sign=True)
        assert (qt.bits, qt.group_size, qt.kind, qt.shape) == (*EXPECTED[t], t.name, (n, k))
        # Q4_0 as q*d + (-8d) gives +0.0 where the reference's d*(q-8) gives -0.0 (d < 0, q = 8): same value.
        assert_same_bits(qt.dequantize(), gguf.quants.dequantize(data, t), zero_sign=t != T.Q4_0)


def test_q4_0_differs_only_in_zero_sign():
    data = random_blocks(np.random.default_rng(1), T.Q4_0, 8, 96, edge=True)
    got, ref = from_gguf(data, T.Q4_0, (8, 96)).dequantize(), torch.from_numpy(gguf.quants.dequantize(data, T.Q4_0))
    diff = got.view(torch.int32) != ref.view(torch.int32)
    assert diff.any() and (got[diff] == 0).all() and torch.signbit(ref[diff]).all()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_codes_are_the_encoded_codes(t):
    """The codes the kernels get are the stored ones (minus the zero point of the signed formats)."""
    n, k = 4, 2 * GGML_QUANT_SIZES[t][0]
    fields = random_fields(np.random.default_rng(t.value), t, n * 2, edge=True)
    qt = from_gguf(pack_blocks(t, fields).reshape(n, -1), t, (n, k))
    expected = torch.from_numpy(fields["q"].reshape(n, k) - ZERO_POINT.get(t, 0)).to(torch.int8)
    assert qt.q.dtype == torch.int8 and torch.equal(qt.q, expected)
    if qt.bits == 4:
        assert 0 <= int(qt.q.min()) and int(qt.q.max()) <= 15


def test_through_gguf_writer_and_reader(tmp_path):
    rng = np.random.default_rng(2)
    written = {f"w.{t.name}": (random_blocks(rng, t, 3, 2 * GGML_QUANT_SIZES[t][0], edge=True), t) for t in TYPES}
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    for name, (raw, t) in written.items():
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=t)  # uint8 raw_shape: (N, bytes per row)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = gguf.GGUFReader(tmp_path / "tiny.gguf").tensors
    assert sorted(r.name for r in tensors) == sorted(written)
    for r in tensors:
        raw, t = written[r.name]
        shape = tuple(reversed(r.shape.tolist()))  # GGUF lists dims innermost first
        qt = from_gguf(r.data, r.tensor_type, shape)
        assert qt.kind == t.name and qt.shape == (3, 2 * GGML_QUANT_SIZES[t][0])
        assert torch.equal(qt.q, from_gguf(raw, t, shape).q)
        assert_same_bits(qt.dequantize(), gguf.quants.dequantize(raw, t), zero_sign=t != T.Q4_0)


def test_from_gguf_rejects_what_it_cannot_decode():
    data = random_blocks(np.random.default_rng(3), T.Q8_0, 2, 64)
    with pytest.raises(ValueError, match="GGUF type IQ2_XXS is not supported"):  # Q2_K is read now
        from_gguf(data, T.IQ2_XXS, (2, 256))
    with pytest.raises(ValueError, match=r"\(2, 96\)"):
        from_gguf(data, T.Q8_0, (2, 96))  # too few bytes
    with pytest.raises(ValueError, match="K % 32"):
        from_gguf(data, T.Q8_0, (4, 16))  # right byte count, K not a multiple of the block


def _decoded(t: T, n: int, k: int, seed: int) -> QuantizedTensor:
    return from_gguf(random_blocks(np.random.default_rng(seed), t, n, k, edge=True), t, (n, k))


def test_concat_rows_mixed_formats_is_lossless():
    parts = [_decoded(T.Q4_K, 2, 512, 4), _decoded(T.Q6_K, 3, 512, 5), _decoded(T.Q8_0, 4, 512, 6)]
    fused = concat_rows(parts)
    assert (fused.kind, fused.bits, fused.group_size, fused.shape) == ("Q4_K+Q6_K+Q8_0", 8, 16, (9, 512))
    assert fused.offset is not None
    expected = torch.cat([p.dequantize() for p in parts])
    # The symmetric parts hold -0.0 weights; a +0.0 offset filler would turn them into +0.0.
    assert ((expected[2:] == 0) & torch.signbit(expected[2:])).any()
    assert_same_bits(fused.dequantize(), expected)


def test_concat_rows_same_kind_and_rtn_groups():
    same = concat_rows([_decoded(T.Q4_K, 2, 256, 7), _decoded(T.Q4_K, 1, 256, 8)])
    assert (same.kind, same.bits, same.group_size) == ("Q4_K", 4, 32)

    w = torch.randn(6, 256)
    parts = [quantize_rtn(w[:2], "int8"), quantize_rtn(w[2:], "int4_g128"), quantize_rtn(w[:3], "int4")]
    fused = concat_rows(parts)
    assert (fused.kind, fused.bits, fused.group_size) == ("int8+int4_g128+int4_g32", 8, 32)
    assert_same_bits(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_concat_rows_rejects_mismatches():
    with pytest.raises(ValueError, match="one K"):
        concat_rows([quantize_rtn(torch.randn(2, 64), "int8"), quantize_rtn(torch.randn(2, 96), "int8")])
    odd = QuantizedTensor(torch.zeros(1, 96, dtype=torch.int8), torch.ones(1, 2), None, 8, 48, "odd")
    with pytest.raises(ValueError, match="multiples of 32"):
        concat_rows([odd, quantize_rtn(torch.randn(1, 96), "int4")])
    with pytest.raises(ValueError, match="one K"):
        concat_rows([])


@pytest.mark.parametrize("t", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)  # with and without offsets
def test_select_rows(t):
    qt = _decoded(t, 6, 256, 9)
    index = torch.tensor([5, 0, 3, 3])
    picked = qt.select_rows(index)
    assert (picked.shape, picked.bits, picked.group_size, picked.kind) == ((4, 256), qt.bits, qt.group_size, t.name)
    assert (picked.offset is None) == (qt.offset is None)
    assert_same_bits(picked.dequantize(), qt.dequantize()[index])


def test_nbytes():
    assert _decoded(T.Q4_K, 4, 512, 10).nbytes() == 4 * 256 + 2 * (4 * 16 * 4)  # nibbles + scale + offset
    assert _decoded(T.Q8_0, 3, 64, 11).nbytes() == 3 * 64 + 3 * 2 * 4  # bytes + scale, no offset
    assert _decoded(T.Q6_K, 2, 256, 12).nbytes() == 2 * 256 + 2 * 16 * 4
    assert quantize_rtn(torch.randn(2, 128), "int4_g128").nbytes() == 2 * 64 + 2 * 4 + 2 * 4


def test_invalid_parts_are_rejected():
    with pytest.raises(ValueError, match="scale"):
        QuantizedTensor(torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 3), None, 8, 32, "bad")
    with pytest.raises(ValueError, match="group 48"):
        QuantizedTensor(torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 1), None, 8, 48, "bad")


def test_rtn_int8():
    w = torch.randn(16, 96) * torch.logspace(-4, 2, 16)[:, None]
    w[3] = 0
    qt = quantize_rtn(w, "int8")
    assert (qt.kind, qt.bits, qt.group_size, qt.offset, tuple(qt.scale.shape)) == ("int8", 8, 96, None, (16, 1))
    assert int(qt.q.abs().max()) == 127 and (qt.q.abs().amax(dim=1) == 127).sum() == 15  # all rows but the zero one
    deq = qt.dequantize()
    assert torch.equal(deq[3], torch.zeros(96))
    err = (deq.double() - w.double()).abs()
    assert (err <= qt.scale.double() / 2 * (1 + 1e-6)).all()


def test_rtn_int8_is_idempotent():
    """Re-quantizing a dequantized int8 weight reproduces codes, scales and values exactly."""
    first = quantize_rtn(torch.randn(256, 64) * torch.rand(256, 1) ** 4 * 10, "int8")
    again = quantize_rtn(first.dequantize(), "int8")
    assert torch.equal(again.q, first.q) and torch.equal(again.scale, first.scale)
    assert_same_bits(again.dequantize(), first.dequantize())


@pytest.mark.parametrize("scheme, group", [("int4", 32), ("int4_g32", 32), ("int4_g128", 128)])
def test_rtn_int4(scheme, group):
    w = torch.randn(8, 256) * 3 + 1
    w[0, group:2 * group] = 3.25  # a constant group
    w[1, :group] = 0  # an all-zero group
    qt = quantize_rtn(w, scheme)
    assert (qt.kind, qt.bits, qt.group_size, tuple(qt.scale.shape)) == (f"int4_g{group}", 4, group, (8, 256 // group))
    assert qt.offset is not None and int(qt.q.min()) == 0 and int(qt.q.max()) == 15
    deq = qt.dequantize()
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[0, group:2 * group], w[0, group:2 * group]) and torch.equal(deq[1, :group], w[1, :group])
    err = (deq.double() - w.double()).abs().view(8, -1, group)  # (N, K/g, g)
    bound = qt.scale.double()[..., None] / 2 * (1 + 1e-5) + 1e-6 * w.double().abs().view(8, -1, group)
    assert (err <= bound).all()
    assert torch.equal(quantize_rtn(deq, scheme).q, qt.q)  # re-quantizing keeps the codes


def test_rtn_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(4, 48\)"):
        quantize_rtn(torch.randn(4, 48), "int4")
    with pytest.raises(ValueError, match=r"\(2, 96\)"):
        quantize_rtn(torch.randn(2, 96), "int4_g128")
    with pytest.raises(ValueError, match="unknown scheme"):
        quantize_rtn(torch.randn(2, 64), "int3")
    with pytest.raises(ValueError, match="2-D"):
        quantize_rtn(torch.randn(64), "int8")
