"""Paged K/V tensors, sized from a memory budget or a block count."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.quant import KVScales, is_8bit


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token and one block of KV cost. MHA / GQA / MQA differ only in num_kv_heads;
    `dtype` is the storage dtype (an 8-bit float for an 8-bit pool; its scales are per layer and
    cost no bytes per token)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError("KV cache dimensions must be positive")

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

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
                 scales: KVScales | None = None) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.scales = scales or KVScales.ones(spec.num_layers)
        # NOTE: a pool in the model's dtype stores K/V as they are: a scale there would be silently ignored
        if not is_8bit(spec.dtype) and set(self.scales.k + self.scales.v) != {1.0}:
            raise ValueError("scales apply to an 8-bit KV cache only")
        if len(self.scales.k) != spec.num_layers or len(self.scales.v) != spec.num_layers:
            raise ValueError("one K and one V scale per layer")
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)
