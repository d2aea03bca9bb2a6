"""Attention over paged K/V: write this step's K/V by slot, read each sequence's by block table.

Packed layout: decodes (one query token each) come first, longest first, then prefills /
prefill chunks. Decodes of similar length share one SDPA call over block-gathered K/V
(padding masked); each prefill runs its own call, causal and bottom-right aligned when a
cached prefix exists. On CUDA every call is mask-free or uses a lower-right causal bias,
so the Flash backend is the one selected.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kvcache.storage import PagedKVCache

MAX_DECODE_GROUPS = 4
MIN_GROUP_FILL = 0.7  # a decode joins a group only if its length is >= 70% of the group's longest


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes [start, end) attended in one call: K/V of `num_blocks` blocks each, padded."""

    start: int
    end: int
    num_blocks: int
    block_ids: torch.Tensor  # ((end - start) * num_blocks,) flat, row-major
    mask: torch.Tensor | None  # (n, 1, 1, num_blocks * bs) additive; None for a lone sequence
    length: int  # longest sequence in the group


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step's layout; built once, shared by all layers."""

    num_decodes: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # tokens already in the cache before this step
    slot_mapping: torch.Tensor  # (T,) flat slot of each new token
    block_tables: torch.Tensor  # (B, max_blocks), padded with 0
    decode_groups: tuple[DecodeGroup, ...]

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens))

    @classmethod
    def build(cls, query_lens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, num_decodes: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> AttentionMetadata:
        if any(q != 1 for q in query_lens[:num_decodes]):
            raise ValueError("decodes must come first and have exactly one query token")
        max_blocks = max(len(t) for t in block_tables)
        tables = np.zeros((len(block_tables), max_blocks), dtype=np.int64)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        seq_idx = np.repeat(np.arange(len(query_lens)), query_lens)
        starts = np.repeat(np.asarray(context_lens) - np.cumsum([0, *query_lens[:-1]]), query_lens)
        pos = starts + np.arange(len(seq_idx))  # absolute position of every new token
        slots = tables[seq_idx, pos // block_size] * block_size + pos % block_size
        lens = [c + 1 for c in context_lens[:num_decodes]]
        groups = tuple(_decode_group(tables, lens, s, e, block_size, device, dtype)
                       for s, e in _group_bounds(lens))
        return cls(num_decodes, tuple(query_lens), tuple(context_lens), torch.from_numpy(slots).to(device),
                   torch.from_numpy(tables).to(device), groups)


def _group_bounds(lens: Sequence[int]) -> list[tuple[int, int]]:
    """Split decodes (sorted longest first) into runs of similar length, to limit padding."""
    bounds, start = [], 0
    for i in range(1, len(lens)):
        if lens[i] < MIN_GROUP_FILL * lens[start] and len(bounds) < MAX_DECODE_GROUPS - 1:
            bounds.append((start, i))
            start = i
    if lens:
        bounds.append((start, len(lens)))
    return bounds


def _decode_group(tables: np.ndarray, lens: Sequence[int], start: int, end: int, block_size: int,
                  device, dtype) -> DecodeGroup:
    length = max(lens[start:end])
    num_blocks = -(-length // block_size)
    ids = torch.from_numpy(np.ascontiguousarray(tables[start:end, :num_blocks]).reshape(-1)).to(device)
    mask = None
    if end - start > 1:
        valid = torch.from_numpy(np.arange(num_blocks * block_size)[None, :] < np.asarray(lens[start:end])[:, None])
        # NOTE: a float mask built once per step; a bool one would be converted in every layer
        mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))
        mask = mask.view(end - start, 1, 1, -1).to(device)
    return DecodeGroup(start, end, num_blocks, ids, mask, length)


def _bottom_right_causal(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """(Sq, Sk) bool: query i (the last Sq of Sk positions) may see keys j <= i + Sk - Sq."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(diagonal=num_keys - num_queries)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Flat block ids of num_seqs equal-length tables -> (num_seqs, Hkv, nb * bs, D)."""
    blocks = cache.index_select(0, block_ids)  # (n * nb, bs, Hkv, D): a memcpy per block
    return blocks.view(num_seqs, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


@dataclass(frozen=True)
class PagedAttention:
    """The `AttentionFn` for serving: one per step, binding the cache to that step's metadata."""

    cache: PagedKVCache
    meta: AttentionMetadata

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]  # (N, bs, Hkv, D)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self.meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self.meta.slot_mapping, v)
        out = torch.empty_like(q)  # (T, H, D)
        meta = self.meta
        if q.is_cuda:
            self._per_sequence(q, k, v, k_cache, v_cache, out, 0)
            return out
        for g in meta.decode_groups:
            n = g.end - g.start
            keys = _gather(k_cache, g.block_ids, n)  # (n, Hkv, L, D)
            values = _gather(v_cache, g.block_ids, n)
            if g.mask is None:  # a lone sequence: cut to its length, no mask needed
                keys, values = keys[:, :, :g.length], values[:, :, :g.length]
            qg = q[g.start:g.end].unsqueeze(2)  # (n, H, 1, D)
            res = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask,
                                                 enable_gqa=num_kv_heads != q.shape[1])
            out[g.start:g.end] = res.squeeze(2)
        self._per_sequence(q, k, v, k_cache, v_cache, out, meta.num_decodes)
        return out

    def _per_sequence(self, q, k, v, k_cache, v_cache, out, first: int) -> None:
        meta, bs = self.meta, k_cache.shape[1]
        start = sum(meta.query_lens[:first])
        for i in range(first, len(meta.query_lens)):
            n, ctx = meta.query_lens[i], meta.context_lens[i]
            qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # (1, H, Sq, D)
            if ctx == 0:  # whole sequence is new: attend to this step's K/V directly
                ki = k[start:start + n].transpose(0, 1).unsqueeze(0)  # (1, Hkv, S, D)
                vi = v[start:start + n].transpose(0, 1).unsqueeze(0)
            else:
                total = ctx + n
                ids = meta.block_tables[i, : -(-total // bs)]
                ki = _gather(k_cache, ids, 1)[:, :, :total]  # (1, Hkv, L, D)
                vi = _gather(v_cache, ids, 1)[:, :, :total]
            out[start:start + n] = _sdpa_causal(qi, ki, vi).squeeze(0).transpose(0, 1)  # (Sq, H, D)
            start += n


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention where q is the last Sq of Sk positions."""
    num_q, num_k = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if num_q == num_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if num_q == 1:  # a lone query sees every key: no mask at all
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(num_q, num_k), enable_gqa=gqa)
    mask = _bottom_right_causal(num_q, num_k, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
