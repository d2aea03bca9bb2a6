"""Weight-only quantized linears and embeddings (codes + group scales/offsets, models/quant_formats.py).

On CPU the codes stay packed: a decode step reads 4 or 8 bits per weight instead of 16 or 32. With
exact activations (models/csrc/quant_linear.cpp) x stays fp32 and the result is that of the
dequantized weights; with int8 activations (models/csrc/q8_linear.cpp) each row of x is rounded to
int8 per block of 32 and multiplied by the codes with integer dot products, as llama.cpp does. On CUDA, 4-bit codes in groups of 32-256 run torch's tinygemm kernel
(`_weight_int4pack_mm`: bf16 activations, scales and zeros rounded to bf16); anything else is
dequantized for each call (correct, not fast). Without a C++ compiler on CPU the weights are
dequantized once at load (the bytes are then not saved).
"""
from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models.native.cpu_path import TABLE_CODES
from models.native.libraries import available
from models.quant_formats import RowStack, dequantize_codes

if TYPE_CHECKING:
    from models.quant_formats import GGUFRows, QuantizedTensor

    RowSource = QuantizedTensor | GGUFRows | RowStack

ACTIVATIONS = ("exact", "int8")  # x as given (fp32 sums), or rounded to int8 per block (integer dot products)

_LIB = torch.library.Library("attnserve", "FRAGMENT")
_LIB.define("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias, int bits, "
            "int group_size, SymInt out_features) -> Tensor")
_LIB.define("pack_quant(Tensor q, Tensor scale, Tensor? offset, int bits, int group_size) -> (Tensor, Tensor, Tensor)")
_LIB.define("q8_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, Tensor? bias, int bits, "
            "int group_size, SymInt out_features, Tensor? prompt_rows=None) -> Tensor")
_LIB.define("pack_q8(Tensor q, Tensor scale, Tensor? offset, int bits, int group_size, Tensor? superblocks=None) -> "
            "(Tensor, Tensor, Tensor)")
# rows `ids` of a packed matrix as fp32 (T, in_features): a tied embedding's lookup (QuantEmbedding)
for _name in ("quant_rows", "q8_rows"):
    _LIB.define(f"{_name}(Tensor codes, Tensor scales, Tensor offsets, Tensor ids, int bits, int group_size, "
                "int in_features, int out_features) -> Tensor")


@torch.library.register_fake("attnserve::quant_linear")
def _(x, codes, scales, offsets, bias, bits, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("attnserve::q8_linear")
def _(x, codes, scales, offsets, bias, bits, group_size, out_features, prompt_rows=None):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("attnserve::quant_rows")
@torch.library.register_fake("attnserve::q8_rows")
def _(codes, scales, offsets, ids, bits, group_size, in_features, out_features):
    return codes.new_empty((ids.numel(), in_features), dtype=torch.float32)


class QuantLinear(nn.Module):
    """y = x @ dequantize(W)^T + b, W kept as codes; x and y keep x's dtype. `activations="int8"`:
    x rounded to int8 per block of 32 first, where the packed kernel takes this weight's groups."""

    def __init__(self, weight: RowSource, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: str | torch.device = "cpu", activations: str = "exact") -> None:
        """`weight`: a QuantizedTensor, or a matrix read a chunk of rows at a time (models/quant_formats.py
        GGUFRows, RowStack), which packing never holds whole."""
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}")
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size, self.kind = weight.bits, weight.group_size, weight.kind
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=False)
        self.mode = linear_mode(weight, torch.device(device))
        self.int8_activations = self.mode == "packed" and activations == "int8" and int8_packable(weight)
        self.parts = None  # or the QuantLinears of a fused matrix's runs of one kind, side by side
        runs = kind_runs(weight) if self.int8_activations else []
        if len(runs) > 1:
            # NOTE: a fused matrix of mixed GGUF types (Q4_K_M's q/k/v: Q4_K, Q4_K, Q6_K) packed as one would take
            # the generic form (8-bit codes, fp32 scales per 16: 12 bits a weight); each run keeps its own form
            biases = [None] * len(runs) if bias is None else bias.split([r.shape[0] for r in runs])
            self.parts = nn.ModuleList(QuantLinear(r, b, dtype, device, activations) for r, b in zip(runs, biases))
            self.bias = None
            return
        if self.mode == "packed":
            self.bits = packed_bits(weight, self.int8_activations)
            codes, scales, offsets = pack_by_rows(weight, self.int8_activations)
            self.register_buffer("codes", codes, persistent=False)  # (panels, K * W * |self.bits| / 8) uint8
            # (panels, groups, W) fp32 or fp16; or a K-quant's superblock records (panels, K / 256, bytes) uint8
            self.register_buffer("scales", scales, persistent=False)
            self.register_buffer("offsets", offsets, persistent=False)  # like scales (records: dmin), or (0,): none
            return
        weight = weight.materialize()
        if self.mode == "dense":
            self.register_buffer("weight", weight.dequantize().to(device, dtype), persistent=False)  # (N, K)
        elif self.mode == "tinygemm":
            q = weight.q.to(torch.int32)
            nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (N, K / 2): even k in the high nibble
            self.register_buffer("codes", torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), 2),
                                 persistent=False)
            # NOTE: tinygemm computes (q - 8) * scale + zero: our offset moves by 8 scales
            offset = weight.offset if weight.offset is not None else torch.zeros_like(weight.scale)
            scales_and_zeros = torch.stack([weight.scale, offset + 8 * weight.scale], dim=-1)  # (N, K / G, 2)
            self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(
                device, torch.bfloat16), persistent=False)  # (K / G, N, 2)
        else:  # codes on the GPU, dequantized per call
            self.register_buffer("q", weight.q.to(device), persistent=False)  # (N, K) int8
            self.register_buffer("scale", weight.scale.to(device), persistent=False)  # (N, K / G)
            self.register_buffer("offset", None if weight.offset is None else weight.offset.to(device),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([part(x) for part in self.parts], dim=-1)
        if self.mode == "packed":
            op = torch.ops.attnserve.q8_linear if self.int8_activations else torch.ops.attnserve.quant_linear
            return op(x, self.codes, self.scales, self.offsets, self.bias, self.bits, self.group_size,
                      self.out_features)
        if self.mode == "dense":
            return F.linear(x, self.weight, self.bias)
        if self.mode == "tinygemm":
            y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.codes,
                                                   self.group_size, self.scales_and_zeros)  # (M, N)
            y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, _dequantize(self.q, self.scale, self.offset, self.group_size, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.kind}, {self.mode}" + (
            ", int8 activations" if self.int8_activations else "")


class QuantEmbedding(nn.Module):
    """Rows of codes gathered, then dequantized: the table stays quantized (a GGUF's token_embd).

    `QuantEmbedding.tied(lm_head)` reads the rows out of a packed LM head's panels instead, so a
    tied table (SmolLM2's, most small models') is held once, not twice (28 MB for the default model)."""

    def __init__(self, weight: QuantizedTensor | None, dtype: torch.dtype, device: str | torch.device = "cpu",
                 packed: QuantLinear | None = None) -> None:
        super().__init__()
        self.out_dtype = dtype
        if packed is not None:
            self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features
            self.group_size, self.kind, self.bits = packed.group_size, packed.kind, packed.bits
            self.int8_layout = packed.int8_activations
            # NOTE: the head's own tensors, registered here too: one storage (weight_bytes counts it once)
            self.register_buffer("codes", packed.codes, persistent=False)  # (panels, K * W * bits / 8) uint8
            self.register_buffer("scales", packed.scales, persistent=False)  # (panels, groups, W)
            self.register_buffer("offsets", packed.offsets, persistent=False)  # (panels, groups, W) or (0,)
            return
        self.num_embeddings, self.embedding_dim = weight.shape
        self.group_size, self.kind, self.bits = weight.group_size, weight.kind, None
        self.register_buffer("q", weight.q.to(device), persistent=False)  # (V, C) int8
        self.register_buffer("scale", weight.scale.to(device), persistent=False)  # (V, C / G)
        self.register_buffer("offset", None if weight.offset is None else weight.offset.to(device), persistent=False)

    @classmethod
    def tied(cls, lm_head: QuantLinear, dtype: torch.dtype) -> QuantEmbedding:
        return cls(None, dtype, packed=lm_head)

    @property
    def weight(self) -> torch.Tensor:
        """The table's dtype and device (DecoderLM reads them from embed.weight)."""
        table = self.scale if self.bits is None else self.scales
        return table.new_empty(0, dtype=self.out_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.bits is not None:
            # NOTE: one native op (~5 us), not the dozen torch ops of gathering out of the panels' layout, which were
            # 0.17-0.20 ms of a 6 ms batch-1 step (Zen 4, Q8_0 file: cold caches after the weights' stream)
            op = torch.ops.attnserve.q8_rows if self.int8_layout else torch.ops.attnserve.quant_rows
            rows = op(self.codes, self.scales, self.offsets, ids.reshape(-1), self.bits, self.group_size,
                      self.embedding_dim, self.num_embeddings)  # (T, C) fp32
            return rows.to(self.out_dtype).view(*ids.shape, self.embedding_dim)
        offset = None if self.offset is None else self.offset[ids]
        return _dequantize(self.q[ids], self.scale[ids], offset, self.group_size, self.out_dtype)  # (T, C)


QUAD = 4  # panels per quad (models/csrc/quant_panels.h)
PACK_ROWS = 256  # rows per chunk: whole quads of panels at any lane count (W = 4, 8, 16)
PACK_WEIGHTS = 1 << 20  # a chunk's weights: its decode holds ~10 bytes a weight for a moment


# kinds whose codes the int8 kernel keeps in their files' bits (TABLE_CODES: IQ4's 4-bit indices into its table)
OWN_BITS = {"Q6_K": 6, "Q5_K": 5, "Q5_1": 5, "IQ4_XS": TABLE_CODES, "IQ4_NL": TABLE_CODES}


def kind_runs(weight: RowSource) -> list[RowSource]:
    """A RowStack of mixed kinds as its runs of consecutive parts of one kind (each a part or a RowStack); [] for
    any other weight."""
    parts = getattr(weight, "parts", None)
    if parts is None or len({p.kind for p in parts}) == 1:
        return []
    runs: list[list] = []
    for p in parts:
        if runs and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [r[0] if len(r) == 1 else RowStack(r) for r in runs]


def packed_bits(weight: RowSource, int8: bool) -> int:
    """The code form a kernel holds `weight` in: for the 8-bit-activation kernel, Q6_K's and Q5's codes in 6 and 5
    bits and IQ4's as table indices (models/csrc/code_planes.h: their files' widths, where 8-bit codes took 8);
    else the weight's own bits."""
    return OWN_BITS.get(weight.kind, weight.bits) if int8 else weight.bits


def _pack(w: QuantizedTensor, int8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if int8:
        return torch.ops.attnserve.pack_q8(w.q, w.scale, w.offset, packed_bits(w, True), w.group_size,
                                           w.superblocks)
    return torch.ops.attnserve.pack_quant(w.q, w.scale, w.offset, w.bits, w.group_size)


def pack_by_rows(weight: RowSource, int8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed (codes, scales, offsets) of `weight` for the 8-bit-activation kernel (`int8`) or the exact one,
    packed a chunk of rows at a time straight into huge pages (huge_page_tensors): a chunk of whole quads of
    panels packs to exactly its panels of the whole, so the whole's codes are never held twice. Per-group scales
    are fp16 where every chunk's were (each exact in fp16, the rule pack applies to a whole); offsets are kept
    where any chunk has one. Superblock records (a K-quant's own scales) go straight to their place."""
    n, k = weight.shape
    step = max(PACK_ROWS, PACK_WEIGHTS // max(k, 1) // PACK_ROWS * PACK_ROWS)
    codes = scales = offsets = None
    half, offset_seen, records, at = True, False, False, 0
    for start in range(0, n, step):
        w = weight.rows(start, min(n, start + step))
        c, sc, of = _pack(w, int8)
        del w
        if codes is None:  # NOTE: every chunk but the last is whole quads of panels: its panels are the whole's
            lanes = step // c.shape[0] if n > step else None  # W: `step` rows pack to step / W panels
            panels = c.shape[0] if lanes is None else -(-n // (QUAD * lanes)) * QUAD  # zero padded, as pack pads
            records = sc.dtype == torch.uint8
            if records:  # NOTE: one form for every chunk: RowStack keeps superblocks only for a stack of one kind
                shapes = [((panels, c.shape[1]), c.dtype), ((panels, *sc.shape[1:]), sc.dtype)]
                codes, scales, *rest = huge_page_tensors(shapes + ([((panels, *of.shape[1:]), of.dtype)]
                                                                    if of.numel() else []))
                offsets = rest[0] if rest else of
            else:
                [codes] = huge_page_tensors([((panels, c.shape[1]), c.dtype)])
                scales = torch.zeros((panels, *sc.shape[1:]), dtype=torch.float32)  # (panels, groups, W)
                offsets = torch.zeros_like(scales)
        codes[at:at + c.shape[0]] = c
        scales[at:at + c.shape[0]] = sc
        if of.numel():
            offsets[at:at + c.shape[0]] = of
            offset_seen = True
        half = half and sc.dtype == torch.float16 and (not of.numel() or of.dtype == torch.float16)
        at += c.shape[0]
    if records:
        return codes, scales, offsets
    dtype = torch.float16 if half else torch.float32  # NOTE: fp16 only where pack found every chunk's exact
    shapes = [(scales.shape, dtype)] + ([(offsets.shape, dtype)] if offset_seen else [])
    packed = huge_page_tensors(shapes)
    for dst, src in zip(packed, (scales, offsets)):
        dst.copy_(src)
    return codes, packed[0], packed[1] if offset_seen else torch.empty(0, dtype=dtype)


def huge_page_tensors(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Empty tensors of these shapes side by side in one anonymous mapping that asks for 2 MiB pages, each
    starting on a cache line.

    Measured (AVX2, 2 threads, batch-1 decode steps, three alternating runs each): the default
    model's 8.5-9.9 ms became 7.5-8.5, the Q8_0 file's 8.6-10.4 became 7.4-9.7. A decode step streams
    every code once, and with 4 KiB pages the hardware prefetchers stop at each page's end."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
    starts = [sum(-(-b // 64) * 64 for b in sizes[:i]) for i in range(len(sizes))]
    total = max(starts[-1] + sizes[-1], 1)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        buffer = torch.empty(total, dtype=torch.uint8)
    else:
        arena = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory gets no THP
        try:
            arena.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
        buffer = torch.frombuffer(arena, dtype=torch.uint8)  # NOTE: holds the mapping while any view lives
    return [buffer[at:at + size].view(dtype).view(shape) for at, size, (shape, dtype) in zip(starts, sizes, shapes)]


def _dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int,
                dtype: torch.dtype) -> torch.Tensor:

    return dequantize_codes(q, scale, offset, group_size).to(dtype)


def int8_packable(weight: QuantizedTensor) -> bool:
    """Whether the 8-bit-activation kernel takes this weight: groups of whole blocks of 32 (16 for
    8-bit codes: Q6_K), and its library builds here."""
    blocks = weight.group_size % 32 == 0 or (weight.bits == 8 and weight.group_size == 16)
    return blocks and available("q8_linear")


def linear_mode(weight: QuantizedTensor, device: torch.device) -> str:
    """How a QuantLinear holds `weight` on `device`: packed (our CPU kernels), dense (dequantized once: no
    compiler), tinygemm (CUDA int4) or codes (dequantized per call)."""
    if device.type == "cuda":
        n, k = weight.shape
        tinygemm = weight.bits == 4 and weight.group_size in (32, 64, 128, 256) and n % 8 == 0 and k % 32 == 0
        return "tinygemm" if tinygemm else "codes"
    if device.type != "cpu":
        return "codes"
    # NOTE: 4-bit codes are packed in runs of 32 inputs: groups must hold whole runs; 8-bit ones
    # are read in pairs
    if available("quant_linear") and weight.group_size % (32 if weight.bits == 4 else 2) == 0:
        return "packed"
    return "dense"
