"""Quantized weights in one lossless form for the kernels: int8 codes with per-group fp32 scales and offsets.

GGUF blocks decode into it so that `dequantize()` equals `gguf.quants.dequantize` bit for bit: every scale and
offset is the float32 value the reference computes before its last multiply/add, and the last ops run in the
same order. `quantize_rtn` makes the same form from float weights (round to nearest, no calibration).
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.native.libraries import available
from models.native.memory import drop_mapped_pages

T = GGMLQuantizationType


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     group_size: int) -> torch.Tensor:
    """(..., K) codes -> (..., K) fp32 weights: code * scale, then + offset, per group of K."""
    shape = q.shape
    w = q.reshape(*shape[:-1], -1, group_size).float() * scale.unsqueeze(-1)  # (..., K / G, G)
    if offset is not None:
        w = w + offset.unsqueeze(-1)
    return w.reshape(shape)


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D weight (N out features, K in features) as integer codes with per-group scales and offsets:
    w[n, k] = q[n, k] * scale[n, k // group_size] + offset[n, k // group_size] (float32: one multiply, then
    one add; no add when offset is None)."""

    q: torch.Tensor  # int8 (N, K); codes in 0..15 when bits == 4
    scale: torch.Tensor  # float32 (N, K // group_size)
    offset: torch.Tensor | None  # float32 (N, K // group_size), or None (symmetric)
    bits: int  # 4: the kernels store nibbles; 8: bytes
    group_size: int  # along K
    kind: str  # source format, for reports: "Q4_K", "int8", "int4_g32", "Q4_K+Q6_K", ...
    # uint8 (N, K / 256, bytes): a K-quant's scales as its file stores them (superblocks()), from which the
    # 8-bit-activation kernel computes scale and offset per group (models/csrc/group_scales.h); or None
    superblocks: torch.Tensor | None = None

    def __post_init__(self):
        n, k = self.q.shape
        groups = (n, k // self.group_size)
        if self.q.dtype != torch.int8 or self.bits not in (4, 8) or k % self.group_size:
            raise ValueError(f"bad {self.kind}: q {self.q.dtype} {tuple(self.q.shape)}, bits {self.bits}, "
                             f"group {self.group_size}")
        sb = self.superblocks
        if sb is not None and (sb.dtype != torch.uint8 or sb.dim() != 3 or tuple(sb.shape[:2]) != (n, k // 256)
                               or k % 256):
            raise ValueError(f"bad {self.kind}: superblocks {sb.dtype} {tuple(sb.shape)} for {n} x {k}")
        for name, t in (("scale", self.scale), ("offset", self.offset)):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != groups):
                raise ValueError(f"bad {self.kind}: {name} {t.dtype} {tuple(t.shape)}, expected float32 {groups}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return dequantize_codes(self.q, self.scale, self.offset, self.group_size)  # (N, K)

    def nbytes(self) -> int:
        n, k = self.shape
        codes = n * k * self.bits // 8
        return codes + 4 * self.scale.numel() * (1 if self.offset is None else 2)

    def select_rows(self, index: torch.Tensor) -> QuantizedTensor:
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return dataclasses.replace(self, q=self.q[index], scale=self.scale[index], offset=pick(self.offset),
                                   superblocks=pick(self.superblocks))

    @property
    def has_offset(self) -> bool:
        return self.offset is not None

    def rows(self, start: int, stop: int) -> QuantizedTensor:
        """Rows start..stop (views): what a packer reads a chunk at a time (RowSource)."""
        return self.select_rows(slice(start, stop))

    def materialize(self) -> QuantizedTensor:
        return self


# --- GGUF -----------------------------------------------------------------------------------------------
# Each decoder maps blocks (B, type_size) uint8 to (codes (B, block) int8, scale (B, block / group) f32,
# offset or None). Layouts: ggml-common.h; arithmetic: gguf.quants.


def _f16(b: np.ndarray) -> np.ndarray:
    """(B, 2) little-endian fp16 bytes -> (B, 1) float32 (exact)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """(..., m) bytes -> (..., 2m): all low nibbles, then all high nibbles (ggml's order)."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def _bits(b: np.ndarray) -> np.ndarray:
    """(B, m) bytes -> (B, 8m) bits, least significant first (a little-endian bit string)."""
    return np.unpackbits(b, axis=-1, bitorder="little")


def _q8_0(b):
    return b[:, 2:].view(np.int8).copy(), _f16(b[:, :2]), None


def _q4_0(b):
    # The reference computes d * (q - 8). With d fp16 (11 significant bits) and q < 16, q*d, -8*d and their
    # sum are all exact in float32, so q*d + (-8d) is the same value; only a zero's sign can differ (+0 here).
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]).astype(np.int8), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:]).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """32 five-bit codes per block: low nibbles from qs, bit j of the little-endian uint32 qh on top of code j."""
    return (_nibbles(qs) | (_bits(qh) << 4)).astype(np.int8)


def _q5_0(b):
    # Signed codes q - 16 and no offset: the reference's d * (q - 16), one exact product.
    return _q5(b[:, 2:6], b[:, 6:]) - 16, _f16(b[:, :2]), None


def _q5_1(b):
    return _q5(b[:, 4:8], b[:, 8:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, 12) packed -> 8 six-bit scales and 8 six-bit mins (B, 8) each (ggml's get_scale_min_k4)."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def _k_scale_offset(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference computes (d*sc) * q - (dmin*m): scale = d*sc, offset = -(dmin*m); x - y is x + (-y)."""
    sc, m = _k_scales(b[:, 4:16])
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * m.astype(np.float32))


def _q4_k(b):
    codes = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 256)  # (B, 4 chunks, 64) -> (B, 256)
    return (codes.astype(np.int8), *_k_scale_offset(b))


def _q5_k(b):
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 256)  # (B, 256)
    high = _bits(b[:, 16:48, None]).transpose(0, 2, 1).reshape(-1, 256)  # bit s of qh[l] -> code 32s+l
    return ((low | (high << 4)).astype(np.int8), *_k_scale_offset(b))


def _q6_k(b):
    # Two halves of 128 codes: ql gives low nibbles of 64 bytes (low nibbles first), qh 2 bits per code.
    low = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(-1, 256)  # (B, 256)
    codes = (low | _crumbs(b[:, 128:192]) << 4).astype(np.int8) - 32  # (B, 256)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # (B, 16)
    return codes, _f16(b[:, 208:]) * sc, None


# The types below decode to 8-bit codes (groups of 16 take no 4-bit kernel; IQ4's codes are a table's values). Q2_K
# and Q3_K load and answer exactly in them; the 8-bit-activation kernel holds IQ4's as their 4-bit indices
# (models/quant_linear.py packed_bits).


def _crumbs(b: np.ndarray) -> np.ndarray:
    """(B, 64) bytes -> (B, 256) two-bit fields: per run of 32 bytes, bits 0-1 of each, then 2-3, 4-5, 6-7."""
    return ((b.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(-1, 256)


def _q2_k(b):
    # The reference computes (d * (sc & 15)) * q - dmin * (sc >> 4) per 16 codes: offset = -(dmin * m).
    sc = b[:, :16]
    scale = _f16(b[:, 80:82]) * (sc & 15).astype(np.float32)
    return _crumbs(b[:, 16:80]).astype(np.int8), scale, -(_f16(b[:, 82:84]) * (sc >> 4).astype(np.float32))


def _q3_k_scales(b: np.ndarray) -> np.ndarray:
    """16 six-bit scales, signed by -32: low nibbles of 8 bytes (all low, then all high), 2 high bits from 4 more."""
    low = _nibbles(b[:, 96:104])  # (B, 16)
    high = (b[:, 104:108, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 2, 1).reshape(-1, 16)
    return (low | (high & 3) << 4).astype(np.int8) - 32


def _q3_k(b):
    sc = _q3_k_scales(b).astype(np.float32)
    # codes: two bits from qs, minus 4 where hmask's bit (bit j of hmask[l] for code 32j + l) is clear
    hbit = _bits(b[:, :32, None]).transpose(0, 2, 1).reshape(-1, 256)
    codes = _crumbs(b[:, 32:96]).astype(np.int8) - ((1 - hbit) << 2).astype(np.int8)
    return codes, _f16(b[:, 108:110]) * sc, None


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(b):
    return IQ4_VALUES[_nibbles(b[:, 2:])], _f16(b[:, :2]), None


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """8 six-bit scales, signed by -32: 4 low bits from scales_l (low nibble first), 2 high bits from scales_h."""
    low = (b[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 15
    high = (b[:, 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32


def _iq4_xs(b):
    sc = _iq4_xs_scales(b).astype(np.float32)
    codes = IQ4_VALUES[_nibbles(b[:, 8:].reshape(-1, 8, 16))].reshape(-1, 256)
    return codes, _f16(b[:, :2]) * sc, None


_DECODERS = {
    T.Q8_0: (_q8_0, 8, 32), T.Q4_0: (_q4_0, 4, 32), T.Q4_1: (_q4_1, 4, 32), T.Q5_0: (_q5_0, 8, 32),
    T.Q5_1: (_q5_1, 8, 32), T.Q4_K: (_q4_k, 4, 32), T.Q5_K: (_q5_k, 8, 32), T.Q6_K: (_q6_k, 8, 16),
    T.Q2_K: (_q2_k, 8, 16), T.Q3_K: (_q3_k, 8, 16), T.IQ4_NL: (_iq4_nl, 8, 32), T.IQ4_XS: (_iq4_xs, 8, 32),
}  # type -> (decoder, bits, group_size)
SUPPORTED_GGUF_TYPES = frozenset(_DECODERS)


def _d_and_scales(d: np.ndarray, sc: np.ndarray) -> np.ndarray:
    return np.concatenate([d, sc.view(np.uint8)], axis=1)


# (B, type_size) blocks -> (B, bytes) superblocks: with mins, the block's first 16 bytes (d, dmin, 12 bytes of
# 6-bit scales and mins); IQ4_XS's first 8 (d and its 6-bit scales); else d then one int8 scale per group
# (models/csrc/group_scales.h)
_SUPERBLOCKS = {
    T.Q4_K: lambda b: b[:, :16], T.Q5_K: lambda b: b[:, :16],
    T.Q6_K: lambda b: _d_and_scales(b[:, 208:210], b[:, 192:208]),
    T.Q3_K: lambda b: _d_and_scales(b[:, 108:110], _q3_k_scales(b)),
    T.IQ4_XS: lambda b: b[:, :8],
}
_OFFSET_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K, T.Q2_K})  # decoders that give offsets
_NATIVE_TYPES = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K})  # gguf_codes's


_LIB = torch.library.Library("attnserve", "FRAGMENT")
# the decoders below in C++ (models/csrc/quant_linear.cpp), where that library builds: codes, scales, offsets
_LIB.define("gguf_codes(Tensor blocks, int tensor_type, int block, int group, bool has_offset) -> "
            "(Tensor, Tensor, Tensor)")


def _native_decode(blocks: np.ndarray, tensor_type: T, block: int, group: int):
    """(codes, scale, offset or None) per block, as the numpy decoder gives them; None without the library."""
    if tensor_type not in _NATIVE_TYPES or not available("quant_linear"):
        return None
    with warnings.catch_warnings():  # NOTE: a read-only view of the file's map: the op only reads it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(blocks)
    q, scale, offset = torch.ops.attnserve.gguf_codes(raw, int(tensor_type), block, group,
                                                      tensor_type in _OFFSET_TYPES)
    return q, scale, offset if offset.numel() else None


def _check_supported(tensor_type: T) -> None:
    if tensor_type not in _DECODERS:
        names = ", ".join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))
        raise ValueError(f"GGUF type {tensor_type.name} is not supported; supported: {names}")


def from_gguf(data: np.ndarray, tensor_type: GGMLQuantizationType, shape: tuple[int, int],
              native: bool = True) -> QuantizedTensor:
    """`data`: GGUFReader's tensor.data (raw uint8 blocks, (N, bytes per row)); `shape`: (N, K). `native`:
    decode in C++ where that library builds (the numpy decoders' values, bit for bit, ~10x faster)."""
    tensor_type = T(tensor_type)
    _check_supported(tensor_type)
    decode, bits, group = _DECODERS[tensor_type]
    block, type_size = GGML_QUANT_SIZES[tensor_type]
    n, k = shape
    if k % block or data.nbytes != n * k // block * type_size:
        raise ValueError(f"{tensor_type.name} tensor of shape {tuple(shape)} needs K % {block} == 0 and "
                         f"{n * k // block * type_size} bytes; got {data.nbytes} bytes")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)  # (B, type_size)
    sb = _SUPERBLOCKS.get(tensor_type)
    superblocks = None if sb is None else torch.from_numpy(np.ascontiguousarray(sb(blocks)).reshape(n, k // 256, -1))
    decoded = _native_decode(blocks, tensor_type, block, group) if native else None
    if decoded is not None:
        q, scale, offset = (None if t is None else t.reshape(n, -1) for t in decoded)  # (N, K or K/g)
        return QuantizedTensor(q, scale, offset, bits, group, tensor_type.name, superblocks)
    q, scale, offset = decode(blocks)
    rows = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))  # noqa: E731  (N, K or K/g)
    return QuantizedTensor(rows(q), rows(scale), None if offset is None else rows(offset), bits, group,
                           tensor_type.name, superblocks)


class GGUFRows:
    """A GGUF matrix decoded a chunk of rows at a time (a RowSource): the loader packs it chunk by chunk, so
    the whole matrix is never held as int8 codes. `data`: its (N, bytes per row) blocks (a view of the file's
    memory map); `order`: which stored row each row is (an un-permutation), or None."""

    def __init__(self, data: np.ndarray, tensor_type: GGMLQuantizationType, k: int,
                 order: torch.Tensor | None = None) -> None:
        self.data, self.tensor_type, self.order = data, T(tensor_type), order
        _check_supported(self.tensor_type)
        _, self.bits, self.group_size = _DECODERS[self.tensor_type]
        self.shape = (len(data), k)
        self.kind = self.tensor_type.name
        self.has_offset = self.tensor_type in _OFFSET_TYPES

    def rows(self, start: int, stop: int) -> QuantizedTensor:
        if self.order is None:
            data = self.data[start:stop]
            decoded = from_gguf(data, self.tensor_type, (stop - start, self.shape[1]))
        else:
            stored = self.order[start:stop].numpy()
            decoded = from_gguf(self.data[stored], self.tensor_type, (stop - start, self.shape[1]))
            data = self.data[stored.min():stored.max() + 1]
        drop_mapped_pages(data)
        return decoded

    def materialize(self) -> QuantizedTensor:
        return self.rows(0, self.shape[0])


class RowStack:
    """RowSources stacked along N (a fused qkv / gate_up of GGUF parts), read a chunk of rows at a time in
    the form concat_rows gives the whole."""

    def __init__(self, parts: list) -> None:
        if not parts or len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"a row stack needs parts with one K; got shapes {[p.shape for p in parts]}")
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.bits, self.group_size, self.has_offset, self.kind = _stacked_format(parts)

    def pieces(self, start: int, stop: int) -> list[QuantizedTensor]:
        """Rows start..stop as each part's rows in them, in order."""
        pieces, first = [], 0
        for p in self.parts:
            lo, hi = max(start, first), min(stop, first + p.shape[0])
            if lo < hi:
                pieces.append(p.rows(lo - first, hi - first))
            first += p.shape[0]
        return pieces

    def rows(self, start: int, stop: int) -> QuantizedTensor:
        return concat_rows(self.pieces(start, stop), like=self)

    def materialize(self) -> QuantizedTensor:
        return self.rows(0, self.shape[0])


def packed_bytes(tensor_type: GGMLQuantizationType, numel: int) -> int:
    """Bytes a GGUF matrix of `numel` weights takes as the kernels hold it: its codes, and fp32 group scales
    (and offsets): an upper bound, as packing keeps fp16 where that is exact."""
    _, bits, group = _DECODERS[T(tensor_type)]
    return numel * bits // 8 + numel // group * 4 * (2 if T(tensor_type) in _OFFSET_TYPES else 1)


def rtn_bytes(scheme: str, n: int, k: int) -> int:
    """Bytes quantize_rtn's form of an (n, k) weight takes packed: int8 codes and a scale per row, or 4-bit
    codes with a scale and an offset per group."""
    if scheme == "int8":
        return n * k + 4 * n
    return n * k // 2 + n * k // _INT4_GROUPS[scheme] * 8


def is_quantized(t) -> bool:
    """A quantized matrix, in memory (QuantizedTensor) or read by rows (GGUFRows, RowStack): a RowSource."""
    return isinstance(t, (QuantizedTensor, GGUFRows, RowStack))


# --- combining and quantizing ------------------------------------------------------------------------------


def _stacked_format(parts) -> tuple[int, int, bool, str]:
    """(bits, group size, has offsets, kind) of parts stacked losslessly: the widest bits, the smallest group."""
    group = min(p.group_size for p in parts)
    if any(p.group_size % group for p in parts):
        raise ValueError(f"group sizes {[p.group_size for p in parts]} are not multiples of {group}")
    kinds = [p.kind for p in parts]
    return (max(p.bits for p in parts), group, any(p.has_offset for p in parts),
            kinds[0] if len(set(kinds)) == 1 else "+".join(kinds))


def concat_rows(parts: list[QuantizedTensor], like=None) -> QuantizedTensor:
    """Stack along N (fused qkv / gate_up) losslessly: the widest bits, the smallest group (scales repeated).
    `like`: the format of a larger stack these parts are rows of (RowStack), else their own."""
    if not parts or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"concat_rows needs parts with one K; got shapes {[p.shape for p in parts]}")
    k = parts[0].shape[1]
    bits, group, has_offset, kind = _stacked_format(parts) if like is None else \
        (like.bits, like.group_size, like.has_offset, like.kind)

    def regroup(t: torch.Tensor, p: QuantizedTensor) -> torch.Tensor:
        return t.repeat_interleave(p.group_size // group, dim=1)  # (N_p, K / group)

    def offset_of(p: QuantizedTensor) -> torch.Tensor:
        # -0.0, not 0.0: x + (-0.0) is x bit for bit, whereas -0.0 + 0.0 would turn a -0.0 weight into +0.0.
        if p.offset is None:
            return torch.full((p.shape[0], k // group), -0.0, dtype=torch.float32)
        return regroup(p.offset, p)

    # NOTE: superblocks only where the whole stack is one kind (`like`'s, not these parts'): every chunk of a
    # RowStack then packs to the same scale form
    one_kind = "+" not in kind and all(p.superblocks is not None for p in parts)
    return QuantizedTensor(
        q=torch.cat([p.q for p in parts]),
        scale=torch.cat([regroup(p.scale, p) for p in parts]),
        offset=torch.cat([offset_of(p) for p in parts]) if has_offset else None,
        bits=bits,
        group_size=group,
        kind=kind,
        superblocks=torch.cat([p.superblocks for p in parts]) if one_kind else None,
    )


_INT4_GROUPS = {"int4": 32, "int4_g32": 32, "int4_g64": 64, "int4_g128": 128}


def quantize_rtn(w: torch.Tensor, scheme: str) -> QuantizedTensor:
    """Round-to-nearest weight-only quantization of a (N, K) weight. "int8": symmetric per output channel;
    "int4" (= "int4_g32"), "int4_g128": asymmetric min/max per group of 32 / 128 along K."""
    if w.dim() != 2:
        raise ValueError(f"quantize_rtn needs a 2-D weight; got shape {tuple(w.shape)}")
    w = w.detach().float()
    n, k = w.shape
    if scheme == "int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127  # (N, 1)
        q = torch.round(w / torch.where(scale == 0, 1.0, scale)).clamp(-127, 127)  # zero row: codes 0
        return QuantizedTensor(q.to(torch.int8), scale, None, 8, k, "int8")
    if scheme not in _INT4_GROUPS:
        raise ValueError(f"unknown scheme {scheme!r}; expected int8 or one of {', '.join(_INT4_GROUPS)}")
    group = _INT4_GROUPS[scheme]
    if k % group:
        raise ValueError(f"{scheme} needs K % {group} == 0; weight shape {tuple(w.shape)}")
    groups = w.reshape(n, k // group, group)  # (N, K/g, g)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # (N, K/g)
    scale = (hi - lo) / 15  # a constant group: scale 0, codes 0, offset = its value (exact)
    q = torch.round((groups - lo[..., None]) / torch.where(scale == 0, 1.0, scale)[..., None]).clamp(0, 15)
    return QuantizedTensor(q.reshape(n, k).to(torch.int8), scale, lo, 4, group, f"int4_g{group}")
