"""`torch.ops.attnserve.paged_attention`: one custom op per layer and step, so torch.compile
traces around it.

It writes the step's new K/V into the pool by slot, then attends every query token to its own
sequence's keys through the block table, causally. An 8-bit pool (kvcache/quant.py) stores K/V
divided by the layer's `k_scale` / `v_scale`, rounded to 8 bits as it writes them, and the op
multiplies the scales back in as it reads. Implementations:

* CPU: the C++ kernel in `kvcache/csrc` (reads blocks in place), built for the CPU's ISA level
  (models/native.py). Where it cannot be built (no compiler) or `ATTNSERVE_NATIVE=0`,
  `sdpa_paged_attention` instead, with a warning.
* CUDA: `torch.nn.attention.varlen.varlen_attn` with the block table (Flash's paged kernel); an
  8-bit pool takes the gather path (Flash's paged kernel reads no 8-bit K/V on this torch).

`sdpa_paged_attention` (gather + SDPA per sequence) also stays as a test oracle.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.nn.functional as F

from kvcache.quant import dequantize, quantize

logger = logging.getLogger(__name__)

_LIB = torch.library.Library("attnserve", "DEF")
_LIB.define(
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, SymInt max_query_len, SymInt max_seq_len, "
    "float scale, float k_scale=1.0, float v_scale=1.0) -> Tensor"
)


@torch.library.register_fake("attnserve::paged_attention")
def _fake(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
          max_query_len, max_seq_len, scale, k_scale=1.0, v_scale=1.0):
    return q.new_empty(q.shape)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter the step's K/V (T, Hkv, D) into the pool's slots, rounded to 8 bits for an 8-bit pool."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k_cache.dtype != k.dtype:
        k, v = quantize(k, k_scale, k_cache.dtype), quantize(v, v_scale, v_cache.dtype)
        # NOTE: index_copy_ has no 8-bit float kernel; the bytes are the same
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, dtype: torch.dtype,
            scale: float) -> torch.Tensor:
    """One sequence's K or V, (1, Hkv, num_tokens, D), copied out of its blocks in `dtype`."""
    blocks = cache.index_select(0, block_ids)  # (nb, bs, Hkv, D)
    rows = blocks.view(-1, cache.shape[2], cache.shape[3])[:num_tokens]  # (L, Hkv, D)
    if rows.dtype != dtype:  # an 8-bit pool: exact, the scale is a power of two
        rows = dequantize(rows, scale, dtype)
    return rows.transpose(0, 1).unsqueeze(0)


def sdpa_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                         max_query_len, max_seq_len, scale, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """The gather path: each sequence's K/V copied out of the pool, then one SDPA call each."""
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    out = torch.empty_like(q)  # (T, H, D)
    bs, gqa = k_cache.shape[1], k_cache.shape[2] != q.shape[1]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, total in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        qi = q[s:e].transpose(0, 1).unsqueeze(0)  # (1, H, Sq, D)
        ids = block_tables[i, : -(-total // bs)].long()
        ki = _gather(k_cache, ids, total, q.dtype, k_scale)  # (1, Hkv, L, D)
        vi = _gather(v_cache, ids, total, q.dtype, v_scale)
        mask = None
        if 1 < e - s < total:  # queries are the last Sq of L positions: bottom-right causal
            mask = torch.ones(e - s, total, dtype=torch.bool, device=q.device).tril(diagonal=total - (e - s))
        out[s:e] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=e - s == total > 1,
                                                  scale=scale, enable_gqa=gqa).squeeze(0).transpose(0, 1)
    return out


def _varlen_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                            max_query_len, max_seq_len, scale, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    if k_cache.dtype != q.dtype:
        return sdpa_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                    query_start_loc, max_query_len, max_seq_len, scale, k_scale, v_scale)

    write_kv(k, v, k_cache, v_cache, slot_mapping)
    cu_seq_k = F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return varlen_attn(q, k_cache, v_cache, query_start_loc, cu_seq_k, max_query_len, max_seq_len, scale=scale,
                       window_size=(-1, 0), enable_gqa=k_cache.shape[2] != q.shape[1], seqused_k=seq_lens,
                       block_table=block_tables)


def _load_native() -> str:
    """Register the CPU implementation: the C++ kernel, else the gather path. Returns which
    ("native-<ISA level>" or "sdpa")."""
    if os.environ.get("ATTNSERVE_NATIVE", "1") != "0":
        try:
            from models.native import load

            return f"native-{load('paged_attention')}"
        except Exception as e:  # noqa: BLE001 - any build failure means: serve on the slower path
            reason = str(e).splitlines()[0]
            warnings.warn(f"attnserve: the C++ paged-attention kernel is unavailable ({reason}); "
                          "attention falls back to gather + SDPA, which is slower", RuntimeWarning, stacklevel=2)
    _LIB.impl("paged_attention", sdpa_paged_attention, "CPU")
    return "sdpa"


_LIB.impl("paged_attention", _varlen_paged_attention, "CUDA")
CPU_BACKEND = _load_native()
