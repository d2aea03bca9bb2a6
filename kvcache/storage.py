"""Paged K/V tensors, sized from a memory budget or a block count."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from kvcache import ops
from kvcache.manager import layer_blocks
from kvcache.quant import KVScales, is_8bit


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token and one block of KV cost. MHA / GQA / MQA differ only in num_kv_heads;
    `dtype` is the storage dtype (an 8-bit float for an 8-bit pool; its scales are per layer and
    cost no bytes per token).

    Layers with a sliding window keep only the blocks inside it, so layers of one kind share a
    block table: a *group* is `group_size` layers of one kind (window), and a block id is one
    block of every layer of the group that holds it. Groups of equal size share one pool (the
    physical tensor of slot i serves layer i of whichever group owns the block), so a block freed
    by a windowed group can hold a global layer's tokens next. With no windows there is one group
    of every layer, as before.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    layer_windows: tuple[int | None, ...] = ()  # per layer, None = global; () = every layer global

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError("KV cache dimensions must be positive")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError("one window (or None) per layer")

    @classmethod
    def of(cls, cfg, dtype: torch.dtype, block_size: int = 16) -> KVCacheSpec:
        """The KV of a model (models.config.ModelConfig), stored in `dtype`."""
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size, cfg.layer_windows)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Layer indices per group: each kind's layers in order, cut into runs of `group_size`."""
        kinds: dict[int | None, list[int]] = {}
        for layer in range(self.num_layers):
            kinds.setdefault(self.window(layer), []).append(layer)
        size = math.gcd(*(len(v) for v in kinds.values()))
        return tuple(tuple(v[i:i + size]) for v in kinds.values() for i in range(0, len(v), size))

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return tuple(self.window(g[0]) for g in self.groups)

    @cached_property
    def layer_group(self) -> tuple[tuple[int, int], ...]:
        """Per layer: (its group, its slot in the group = which physical K/V tensor it uses)."""
        where = {layer: (g, slot) for g, layers in enumerate(self.groups) for slot, layer in enumerate(layers)}
        return tuple(where[layer] for layer in range(self.num_layers))

    @property
    def bytes_per_layer_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype size: a token every layer keeps."""
        return self.num_layers * self.bytes_per_layer_token

    @property
    def bytes_per_block(self) -> int:
        """One block id: `block_size` tokens of every layer of one group."""
        return self.group_size * self.bytes_per_layer_token * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` holds at most between steps: a windowed group keeps
        the blocks covering its last `window` positions (at most one block more than the window)."""
        return sum(layer_blocks(w, self.block_size, num_tokens) for w in self.group_windows)

    def bytes_for(self, num_tokens: int) -> int:
        """KV bytes the pool holds for one sequence of `num_tokens` (block granular)."""
        return self.blocks_for(num_tokens) * self.bytes_per_block

    def num_blocks_for(self, budget_bytes: int) -> int:
        num = budget_bytes // self.bytes_per_block
        if num <= 0:
            raise ValueError(f"KV budget of {budget_bytes} bytes is below one block ({self.bytes_per_block} bytes)")
        return num


class PagedKVCache:
    """Per layer, K and V of shape (num_blocks, block_size, kv_heads, head_dim).

    NOTE: one allocation per layer and kind, not views of one tensor: a compiled step mutates
    them in place, and tensors that alias each other would make it copy.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str | torch.device = "cpu",
                 scales: KVScales | None = None, layers: range | None = None) -> None:
        """`layers`: a pipeline stage's, the only ones it holds K/V for (others are None)."""
        self.spec = spec
        self.num_blocks = num_blocks
        self.scales = scales or KVScales.ones(spec.num_layers)
        # NOTE: a pool in the model's dtype stores K/V as they are: a scale there would be silently ignored
        if not is_8bit(spec.dtype) and set(self.scales.k + self.scales.v) != {1.0}:
            raise ValueError("scales apply to an 8-bit KV cache only")
        if len(self.scales.k) != spec.num_layers or len(self.scales.v) != spec.num_layers:
            raise ValueError("one K and one V scale per layer")
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        held = range(spec.num_layers) if layers is None else layers
        slots = {spec.layer_group[i][1] for i in held}
        k = {s: torch.zeros(shape, dtype=spec.dtype, device=device) for s in sorted(slots)}
        v = {s: torch.zeros(shape, dtype=spec.dtype, device=device) for s in sorted(slots)}
        # NOTE: per layer, its slot's tensor: layers of different groups share one (each block id
        # belongs to one group at a time, so they never write the same block)
        self.k = [k[slot] if i in held else None for i, (_, slot) in enumerate(spec.layer_group)]
        self.v = [v[slot] if i in held else None for i, (_, slot) in enumerate(spec.layer_group)]
        self.tensors = list(k.values()) + list(v.values())
        if torch.device(device).type == "cpu":
            ops.cpu_backend()  # NOTE: the op's CPU implementation is registered before any step reads this pool

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
