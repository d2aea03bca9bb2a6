"""Attention over paged K/V: one `attnserve::paged_attention` call per layer and step.

The step is packed: every scheduled sequence contributes its new tokens (one for a decode, a
chunk for a prefill), each with its own context already in the pool. The op writes the new
K/V by slot and reads each sequence's keys through its block table in place (see kvcache/ops.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvcache import ops  # noqa: F401 - defines torch.ops.attnserve.paged_attention
from kvcache.storage import PagedKVCache
from models.attention import AttentionVariant


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's layout, built once (numpy) and shared by every layer. Slots and block tables
    are per KV group (kvcache/storage.py); `slot_mapping` / `block_tables` are group 0's."""

    slot_mapping: torch.Tensor  # (T,) int64: flat pool slot of each new token
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    seq_lens: torch.Tensor  # (B,) int32: tokens in the cache after this step
    query_start_loc: torch.Tensor  # (B + 1,) int32: sequence i's new tokens are rows [s[i], s[i+1])
    max_query_len: int
    max_seq_len: int
    other_groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # groups 1..: (slot_mapping, block_tables)

    def tables(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping, block_tables) of KV group `group`."""
        return (self.slot_mapping, self.block_tables) if group == 0 else self.other_groups[group - 1]

    @classmethod
    def build(cls, query_lens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """One KV group: `block_tables` per sequence."""
        return cls.build_groups(query_lens, context_lens, [block_tables], block_size, device)

    @classmethod
    def build_groups(cls, query_lens: Sequence[int], context_lens: Sequence[int],
                     group_tables: Sequence[Sequence[Sequence[int]]], block_size: int,
                     device: torch.device | str = "cpu") -> AttentionMetadata:
        """`group_tables[g][i]`: sequence i's block table in KV group g."""
        query = np.asarray(query_lens, dtype=np.int64)
        seq_lens = np.asarray(context_lens, dtype=np.int64) + query
        starts = np.zeros(len(query) + 1, dtype=np.int32)
        np.cumsum(query, out=starts[1:])
        seq_idx = np.repeat(np.arange(len(query)), query)
        pos = np.arange(starts[-1]) - np.repeat(starts[:-1], query) + np.repeat(seq_lens - query, query)
        per_group = []
        for block_tables in group_tables:
            tables = np.zeros((len(block_tables), max(len(t) for t in block_tables)), dtype=np.int32)
            for i, t in enumerate(block_tables):
                tables[i, :len(t)] = t
            slots = tables[seq_idx, pos // block_size].astype(np.int64) * block_size + pos % block_size
            per_group.append((torch.from_numpy(slots).to(device), torch.from_numpy(tables).to(device)))
        (slots, tables), *others = per_group
        return cls(slots, tables, torch.from_numpy(seq_lens.astype(np.int32)).to(device),
                   torch.from_numpy(starts).to(device), int(query.max()), int(seq_lens.max()), tuple(others))


def warm_up_steps(spec, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
    """(ids, positions, layout) of a 2-token prefill and a 1-token decode after it: the steps a compiled
    model is warmed up on. NOTE: their dummy K/V land in block 0, which holds nothing yet; any request
    that later owns it writes every slot before reading."""
    bs, steps = spec.block_size, []
    for query_len, context_len in ((2, 0), (1, 2)):
        total = query_len + context_len
        meta = AttentionMetadata.build_groups([query_len], [context_len],
                                              [[[0] * -(-total // bs)]] * len(spec.groups), bs, device)
        steps.append((torch.zeros(query_len, dtype=torch.long, device=device),
                      torch.arange(context_len, total, device=device), meta))
    return steps


@dataclass(frozen=True)
class PagedAttention:
    """The `AttentionFn` for serving: binds the pool to one step's metadata."""

    cache: PagedKVCache
    meta: AttentionMetadata

    @classmethod
    def one_sequence(cls, cache: PagedKVCache, num_tokens: int) -> PagedAttention:
        """A fresh sequence of num_tokens in blocks 0, 1, ... of every group: a whole prompt through
        the pool, no scheduler. NOTE: groups share blocks here, so the pool needs as many blocks as
        one group's table; only one sequence, computed in one step, ever uses them."""
        bs = cache.spec.block_size
        table = [list(range(-(-num_tokens // bs)))]
        meta = AttentionMetadata.build_groups([num_tokens], [0], [table] * len(cache.spec.groups), bs,
                                              cache.tensors[0].device)
        return cls(cache, meta)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 variant: AttentionVariant | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        m, cache = self.meta, self.cache
        variant = variant or AttentionVariant.plain(q.shape[-1])
        slot_mapping, block_tables = m.tables(cache.spec.layer_group[layer_idx][0])
        return torch.ops.attnserve.paged_attention(
            q, k, v, cache.k[layer_idx], cache.v[layer_idx], slot_mapping, block_tables, m.seq_lens,
            m.query_start_loc, m.max_query_len, m.max_seq_len, variant.scale,
            cache.scales.k[layer_idx], cache.scales.v[layer_idx],
            variant.window or 0, variant.softcap or 0.0, sinks)  # (T, H, D)
