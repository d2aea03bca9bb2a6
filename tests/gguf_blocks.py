"""Raw GGUF blocks from chosen codes and scales, to test the decoder in models/quant_formats.py.

Written from ggml's block structs (ggml-common.h) and its C dequantize loops, not from gguf.quants or the
decoder, so that a layout mistake in either shows up as a mismatch.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

# Finite fp16 bit patterns at the edges: +-0, +-smallest subnormal, largest subnormal, smallest normal,
# +-65504 (max finite), +-1.
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00],
                    dtype=np.uint16)

F16 = None  # a field holding one fp16 per block
# type -> {field: F16 or (values per block, lowest, highest)}, in struct order; codes "q" as stored.
FIELDS = {
    T.Q8_0: {"d": F16, "q": (32, -128, 127)},
    T.Q4_0: {"d": F16, "q": (32, 0, 15)},
    T.Q4_1: {"d": F16, "m": F16, "q": (32, 0, 15)},
    T.Q5_0: {"d": F16, "q": (32, 0, 31)},
    T.Q5_1: {"d": F16, "m": F16, "q": (32, 0, 31)},
    T.Q4_K: {"d": F16, "dmin": F16, "sc": (8, 0, 63), "m": (8, 0, 63), "q": (256, 0, 15)},
    T.Q5_K: {"d": F16, "dmin": F16, "sc": (8, 0, 63), "m": (8, 0, 63), "q": (256, 0, 31)},
    T.Q6_K: {"q": (256, 0, 63), "sc": (16, -128, 127), "d": F16},
}


def _f16_bits(rng: np.random.Generator, n: int, edge: bool) -> np.ndarray:
    """(n,) uint16 patterns: weight-like values, or (edge) any finite value with every EDGE_F16 mixed in."""
    if not edge:
        return (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint16)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] ^= 0x4000  # inf / NaN exponent -> a finite one
    bits[::2] = np.resize(rng.permutation(EDGE_F16), len(bits[::2]))  # all of them once n >= 20
    return bits


def _ints(rng: np.random.Generator, shape: tuple[int, int], lo: int, hi: int, edge: bool) -> np.ndarray:
    """Uniform integers in [lo, hi]; edge: 3/4 of them lo, hi or the middle (the symmetric zero point)."""
    x = rng.integers(lo, hi + 1, shape)
    if edge:
        pick = rng.integers(0, 4, shape)
        x = np.choose(pick, [x, np.full(shape, lo), np.full(shape, hi), np.full(shape, lo + (hi - lo + 1) // 2)])
    return x


def random_fields(rng: np.random.Generator, tensor_type: T, n_blocks: int, edge: bool = False) -> dict:
    """Each field of FIELDS[tensor_type]: fp16 as (n_blocks,) uint16 bits, integers as (n_blocks, count)."""
    return {name: _f16_bits(rng, n_blocks, edge) if spec is F16 else _ints(rng, (n_blocks, spec[0]), *spec[1:], edge)
            for name, spec in FIELDS[tensor_type].items()}


def _nib(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo & 0x0F) | ((hi & 0x0F) << 4)


def _qh32(q: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 qh: uint32 (little-endian) whose bit j is bit 4 of code j. (B, 32) -> (B, 4) bytes."""
    words = (((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return words.astype("<u4").view(np.uint8).reshape(-1, 4)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of get_scale_min_k4: scales/mins 0..3 in the low 6 bits of bytes 0..3 / 4..7; 4..7 split into
    a low nibble in bytes 8..11 (scale low, min high) and two high bits on top of bytes 0..3 / 4..7."""
    return np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                           _nib(sc[:, 4:], m[:, 4:])], axis=1)


def _k_qs(q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs: 4 chunks of 32 bytes; byte l of chunk c holds codes 64c+l (low) and 64c+32+l (high)."""
    q = q.reshape(-1, 4, 2, 32)  # (B, chunk, half, l)
    return _nib(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)


def pack_blocks(tensor_type: T, f: dict) -> np.ndarray:
    """Fields (random_fields' layout) -> (n_blocks, type_size) uint8 blocks."""
    f16 = {name: v.astype("<u2").view(np.uint8).reshape(-1, 2) for name, v in f.items() if v.ndim == 1}
    q = f["q"]
    if tensor_type == T.Q8_0:
        parts = [f16["d"], q.astype(np.int8).view(np.uint8)]
    elif tensor_type in (T.Q4_0, T.Q4_1):
        parts = [f16["d"], *([f16["m"]] if "m" in f16 else []), _nib(q[:, :16], q[:, 16:])]
    elif tensor_type in (T.Q5_0, T.Q5_1):
        parts = [f16["d"], *([f16["m"]] if "m" in f16 else []), _qh32(q), _nib(q[:, :16], q[:, 16:])]
    elif tensor_type == T.Q4_K:
        parts = [f16["d"], f16["dmin"], _k_scales(f["sc"], f["m"]), _k_qs(q)]
    elif tensor_type == T.Q5_K:
        # qh[l] bit s is bit 4 of code 32s + l
        qh = (((q.reshape(-1, 8, 32) >> 4) & 1) << np.arange(8)[:, None]).sum(axis=1)  # (B, 32)
        parts = [f16["d"], f16["dmin"], _k_scales(f["sc"], f["m"]), qh, _k_qs(q)]
    elif tensor_type == T.Q6_K:
        # Per half of 128 codes, index 32t + l: ql bytes l / 32+l hold t=0 / t=1 (low) and t=2 / t=3 (high),
        # qh byte l holds bits 4..5 of code t at bits 2t..2t+1.
        q6 = q.reshape(-1, 2, 4, 32)  # (B, half, t, l)
        ql = np.concatenate([_nib(q6[:, :, 0], q6[:, :, 2]), _nib(q6[:, :, 1], q6[:, :, 3])], axis=2)  # (B, 2, 64)
        qh = ((q6 >> 4) << (2 * np.arange(4))[:, None]).sum(axis=2)  # (B, 2, 32)
        parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), f["sc"].astype(np.int8).view(np.uint8), f16["d"]]
    else:
        raise ValueError(f"no encoder for {tensor_type.name}")
    out = np.concatenate([p.astype(np.uint8) for p in parts], axis=1)
    assert out.shape[1] == GGML_QUANT_SIZES[tensor_type][1]
    return out


def random_blocks(rng: np.random.Generator, tensor_type: T, n: int, k: int, edge: bool = False) -> np.ndarray:
    """A (n, k) tensor as GGUF stores it: (n, bytes per row) uint8."""
    block, type_size = GGML_QUANT_SIZES[tensor_type]
    fields = random_fields(rng, tensor_type, n * k // block, edge)
    return pack_blocks(tensor_type, fields).reshape(n, k // block * type_size)


# --- quantizing float weights -------------------------------------------------------------------------
# Round to nearest with min/max scales: no search (llama.cpp's make_qx_quants / make_qkx2_quants try
# several scales), so the error is somewhat above llama.cpp's, but the blocks are valid and the weights
# they decode to stay close to the input. Every code is computed against the fp16 (and, for K-quants,
# 6/8-bit sub-scale) values the decoder will actually use, and those are rounded outwards (scales up, mins
# down) so that no code has to be clipped, even where a scale is an fp16 subnormal (weights ~1e-4).


def _to_f16(x: np.ndarray, down: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (fp16 bit patterns uint16, the float32 value those bits hold): the nearest fp16 at or
    beyond x, away from zero (a scale); `down`: at or below x (a min)."""
    x = np.asarray(x, dtype=np.float32)
    h = x.astype(np.float16)
    v = h.astype(np.float32)
    if down:
        h = np.where(v > x, np.nextafter(h, np.float16(-np.inf)), h)
    else:
        h = np.where(np.abs(v) < np.abs(x), np.nextafter(h, np.copysign(np.float16(np.inf), h)), h)
    h = np.asarray(h, dtype=np.float16)
    return h.view(np.uint16), h.astype(np.float32)


def _inv(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 where d == 0 (an all-zero group: every code then says zero)."""
    return np.where(d == 0, 0.0, 1.0 / np.where(d == 0, 1.0, d)).astype(np.float32)


def _codes(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """(B, n) -> (B,) the element of largest magnitude, with its sign (ggml's choice for Q4_0/Q5_0)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _q_sym(x: np.ndarray, levels: int) -> dict:
    """Q4_0 (levels 16) / Q5_0 (32): d = signed max / -(levels/2), code = round(x / d) + levels/2: the
    signed max is code 0, the other end may be clipped by one step (as in ggml)."""
    half = levels // 2
    d_bits, d = _to_f16(_signed_max(x) / -half)
    return {"d": d_bits, "q": _codes(x * _inv(d)[:, None] + half, 0, levels - 1)}


def _q_asym(x: np.ndarray, levels: int) -> dict:
    """Q4_1 / Q5_1: x = d * code + m with m = block min, d = range / (levels - 1)."""
    m_bits, m = _to_f16(x.min(axis=-1), down=True)
    d_bits, d = _to_f16((x.max(axis=-1) - m) / (levels - 1))
    return {"d": d_bits, "m": m_bits, "q": _codes((x - m[:, None]) * _inv(d)[:, None], 0, levels - 1)}


def _q8_0(x: np.ndarray) -> dict:
    d_bits, d = _to_f16(np.abs(x).max(axis=-1) / 127)
    return {"d": d_bits, "q": _codes(x * _inv(d)[:, None], -127, 127)}


def _q_k(x: np.ndarray, levels: int) -> dict:
    """Q4_K / Q5_K: 8 sub-blocks of 32, each x = (d*sc) * code - (dmin*m) with 6-bit sc, m >= 0. The
    offset rounds up to cover the sub-block's min and the scale up to reach its max: no code is clipped."""
    xs = x.reshape(-1, 8, 32)  # (B, sub-block, 32)
    mins = -np.minimum(xs.min(axis=-1), 0)  # (B, 8) >= 0: the offset only subtracts, so a min above 0 is 0
    dmin_bits, dmin = _to_f16(mins.max(axis=-1) / 63)
    m = np.minimum(np.ceil(mins * _inv(dmin)[:, None]), 63).astype(np.int64)
    eff_min = (dmin[:, None] * m).astype(np.float32)  # what the decoder subtracts
    need = (xs.max(axis=-1) + eff_min) / (levels - 1)  # (B, 8): the step that reaches the max
    d_bits, d = _to_f16(need.max(axis=-1) / 63)
    sc = np.minimum(np.ceil(need * _inv(d)[:, None]), 63).astype(np.int64)
    eff_scale = (d[:, None] * sc).astype(np.float32)  # what it multiplies by
    q = _codes((xs + eff_min[..., None]) * _inv(eff_scale)[..., None], 0, levels - 1)
    return {"d": d_bits, "dmin": dmin_bits, "sc": sc, "m": m, "q": q.reshape(-1, 256)}


def _q6_k(x: np.ndarray) -> dict:
    """16 sub-blocks of 16: x = (d*sc) * (code - 32), sc int8 (here >= 0), codes 0..63."""
    xs = x.reshape(-1, 16, 16)
    need = np.abs(xs).max(axis=-1) / 31  # (B, 16): |x| <= 31 steps, inside -32..31
    d_bits, d = _to_f16(need.max(axis=-1) / 127)
    sc = np.minimum(np.ceil(need * _inv(d)[:, None]), 127).astype(np.int64)
    eff_scale = (d[:, None] * sc).astype(np.float32)
    q = _codes(xs * _inv(eff_scale)[..., None], -32, 31) + 32
    return {"q": q.reshape(-1, 256), "sc": sc, "d": d_bits}


_QUANTIZERS = {
    T.Q8_0: _q8_0, T.Q4_0: lambda x: _q_sym(x, 16), T.Q5_0: lambda x: _q_sym(x, 32),
    T.Q4_1: lambda x: _q_asym(x, 16), T.Q5_1: lambda x: _q_asym(x, 32),
    T.Q4_K: lambda x: _q_k(x, 16), T.Q5_K: lambda x: _q_k(x, 32), T.Q6_K: _q6_k,
}


def quantize_blocks(w: np.ndarray, tensor_type: T) -> np.ndarray:
    """A float (n, k) weight as GGUF stores it in `tensor_type`: (n, bytes per row) uint8 blocks
    (round to nearest; see above). k must be a multiple of the type's block size."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_blocks needs a 2-D weight; got shape {w.shape}")
    tensor_type = T(tensor_type)
    if tensor_type not in _QUANTIZERS:
        raise ValueError(f"no quantizer for {tensor_type.name}")
    block, type_size = GGML_QUANT_SIZES[tensor_type]
    n, k = w.shape
    if k % block:
        raise ValueError(f"{tensor_type.name} needs k % {block} == 0; got shape {w.shape}")
    with np.errstate(over="ignore"):  # NOTE: fp16 overflow of a huge scale shows up as inf, caught below
        fields = _QUANTIZERS[tensor_type](w.reshape(-1, block))
    if any(v.ndim == 1 and not np.isfinite(v.view(np.float16)).all() for v in fields.values()):
        raise ValueError(f"{tensor_type.name}: a scale does not fit in fp16 (|w| up to {np.abs(w).max()})")
    return pack_blocks(tensor_type, fields).reshape(n, k // block * type_size)
