"""A replica's LoRA adapters as fixed slots of stacked weights, and one step's rows per adapter.

The base linear runs once for every row of a step; `LoraStep.apply` then adds each adapter's
low-rank delta to its own rows only (grouped by adapter, as SGMV does on GPUs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.lora_format import MODULES, LoraShapes


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
        for t in self.tensors():
            t[slot].zero_()


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
        lora_add_reference(y, x, self.slots.a[key], self.slots.bt[key], self.slots.ranks[key], self.meta.rows,
                           self.meta.seg_start, self.meta.seg_slot, list(self.slots.shapes.splits(module)))
        return y
