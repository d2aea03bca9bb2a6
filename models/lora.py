"""A replica's LoRA adapters as fixed slots of stacked weights, and one step's rows per adapter.

The base linear runs once for every row of a step; `LoraStep.apply` then adds each adapter's
low-rank delta to its own rows only (grouped by adapter, as SGMV does on GPUs).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from models.config import ModelConfig
from models.lora_format import MODULES, WEIGHTS, AdapterError, AdapterSpec, LoraShapes, check_adapter, delta_pieces
from models.native.libraries import available, native_enabled

# The grouped delta (models/csrc/lora.cpp): in place on y's rows, opaque to inductor
_LIB = torch.library.Library("attnserve", "FRAGMENT")
_LIB.define("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor ranks, Tensor rows, Tensor seg_start, "
            "Tensor seg_slot, int[] splits) -> ()")


@torch.library.register_fake("attnserve::lora_add_")
def _(y, x, a, bt, ranks, rows, seg_start, seg_slot, splits):
    return None


def lora_shapes(cfg: ModelConfig, max_loras: int, max_lora_rank: int) -> LoraShapes:
    """The slots' and an adapter's shapes for a (whole, unsharded) model of `cfg`."""
    return LoraShapes(cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                      cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.mlp == "swiglu",
                      max_loras, max_lora_rank)


class LoraSlots:
    """`max_loras` slots of every (layer, module)'s A and B, zero until an adapter is installed.

    Per (layer, module) with P pieces, S slots and R = max_lora_rank:
      a[(l, m)]:  (S, P * R, in)  piece p's lora_A in rows [p R, p R + rank), zeros after
      bt[(l, m)]: (S, R, out)     every piece's scale * lora_B.T, piece p in its own output columns
      ranks[(l, m)]: (S, P) int64 on the CPU: 0 = the piece is not a target of that slot's adapter
    """

    def __init__(self, shapes: LoraShapes, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.shapes = shapes
        self.dtype = dtype
        # decided once, not per call: a compiled step reads a plain attribute
        self.native = (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                       and native_enabled() and available("lora"))
        s, r = shapes.max_loras, shapes.max_lora_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        self.ranks: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(shapes.num_layers):
            for m in MODULES:
                splits = shapes.splits(m)
                self.a[layer, m] = torch.zeros(s, len(splits) * r, shapes.in_features(m), dtype=dtype, device=device)
                self.bt[layer, m] = torch.zeros(s, r, sum(splits), dtype=dtype, device=device)
                self.ranks[layer, m] = torch.zeros(s, len(splits), dtype=torch.int64)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.a.values(), *self.bt.values(), *self.ranks.values()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def clear(self, slot: int) -> None:
        # NOTE: every reader (the C++ op, lora_add_reference) takes a piece's first `rank` rows of A and B^T
        # only, so rank 0 empties a piece: the weights behind it are never read (zeroing 78 MB of fp32 slots
        # took 240 ms of an adapter's load)
        for t in self.ranks.values():
            t[slot].zero_()

    def install(self, slot: int, spec: AdapterSpec) -> None:
        """Copies the adapter's weights into `slot` (cleared first), scale folded into B^T; a fused PEFT
        target (Phi-3's qkv_proj) gives every piece the same A and its own rows of B."""
        check_adapter(spec, self.shapes)
        self.clear(slot)
        r = self.shapes.max_lora_rank
        with safe_open(str(Path(spec.path) / WEIGHTS), framework="pt") as f:
            for d in spec.deltas:
                a, b = f.get_tensor(d.a_key), f.get_tensor(d.b_key)  # (rank, in), (out, rank)
                if a.shape != (d.rank, d.in_features) or b.shape != (d.out_features, d.rank):
                    raise AdapterError(f"{d.a_key}: the file changed since it was read")
                key = (d.layer, d.module)
                bounds = [0, *itertools.accumulate(self.shapes.splits(d.module))]
                pieces = delta_pieces(d, self.shapes)
                first = bounds[pieces[0]]  # B's row 0 is this output column
                bt = (b.float() * d.scale).T  # (rank, out) in fp32: rounded once, to the slots' dtype
                for p in pieces:
                    self.a[key][slot, p * r:p * r + d.rank] = a
                    self.bt[key][slot, :d.rank, bounds[p]:bounds[p + 1]] = bt[:, bounds[p] - first:bounds[p + 1] - first]
                    self.ranks[key][slot, p] = d.rank


@dataclass(frozen=True)
class LoraMetadata:
    """One step's rows that have an adapter, grouped by slot; base rows are absent. Tensors, not lists,
    so a compiled step does not specialise on them (cf. AttentionMetadata)."""

    rows: torch.Tensor  # (N,) int64: row indices of the packed batch, segment after segment
    seg_start: torch.Tensor  # (G + 1,) int64: segment g is rows[seg_start[g]:seg_start[g + 1]]
    seg_slot: torch.Tensor  # (G,) int64: segment g's slot

    @staticmethod
    def of(row_slots: list[int | None]) -> LoraMetadata | None:
        """Per packed row its slot (None: the base model) -> the metadata; None when no row has one."""
        order = sorted((s, i) for i, s in enumerate(row_slots) if s is not None)
        if not order:
            return None
        starts, slots = [0], []
        for k, (s, _) in enumerate(order):
            if not slots or slots[-1] != s:
                if slots:
                    starts.append(k)
                slots.append(s)
        starts.append(len(order))
        return LoraMetadata(torch.tensor([i for _, i in order], dtype=torch.int64),
                            torch.tensor(starts, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64))


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, ranks: torch.Tensor,
                       rows: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                       splits: list[int]) -> None:
    """y[rows] += the delta of each segment's slot, in fp32; torch's index_select + mm (the C++ op's oracle
    and its fallback). y: (T, sum(splits)), x: (T, in)."""
    r = bt.shape[1]
    starts = seg_start.tolist()
    for g, slot in enumerate(seg_slot.tolist()):
        idx = rows[starts[g]:starts[g + 1]]
        xs = x.index_select(0, idx).float()  # (n, in)
        delta = torch.zeros(idx.numel(), y.shape[1], dtype=torch.float32, device=y.device)  # (n, out)
        col = 0
        for p, width in enumerate(splits):
            rank = int(ranks[slot, p])
            if rank:
                h = xs @ a[slot, p * r:p * r + rank].float().T  # (n, rank)
                delta[:, col:col + width] = h @ bt[slot, :rank, col:col + width].float()
            col += width
        y.index_copy_(0, idx, (y.index_select(0, idx).float() + delta).to(y.dtype))


@dataclass(frozen=True)
class LoraStep:
    """What a model step receives for LoRA: the slots and this step's rows (like PagedAttention)."""

    slots: LoraSlots
    meta: LoraMetadata

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) = the base linear's output on x (T, in); returns it with each row's delta added."""
        key = (layer, module)
        add = torch.ops.attnserve.lora_add_ if self.slots.native and y.is_cpu else lora_add_reference
        add(y, x, self.slots.a[key], self.slots.bt[key], self.slots.ranks[key], self.meta.rows,
                           self.meta.seg_start, self.meta.seg_slot, list(self.slots.shapes.splits(module)))
        return y
