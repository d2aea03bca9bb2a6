"""`torch.ops.attnserve.paged_attention`: one custom op per layer and step, so torch.compile
traces around it.

It writes the step's new K/V into the pool by slot, then attends every query token to its own
sequence's keys through the block table, causally, with the layer's variant (models/attention.py
`AttentionVariant`): `window` > 0 lets a query at position p see keys (p - window, p] only,
`softcap` > 0 squashes each score to softcap * tanh(score / softcap), and `sinks` (H,) adds one
logit per query head that attends to nothing. With a window, the blocks before the window of a
sequence's first query of the step are stale (the engine hands them on and writes 0 in the table):
no implementation reads them. An 8-bit pool (kvcache/quant.py) stores K/V
divided by the layer's `k_scale` / `v_scale`, rounded to 8 bits as it writes them, and the op
multiplies the scales back in as it reads. Implementations:

* CPU: the C++ kernel in `kvcache/csrc` (reads blocks in place), built for the CPU's ISA level
  (models/native/). Where it cannot be built (no compiler) or `ATTNSERVE_NATIVE=0`,
  `sdpa_paged_attention` instead, with a warning. Registered by the first pool on the CPU, not
  at import: importing this module compiles nothing.
* CUDA: `torch.nn.attention.varlen.varlen_attn` with the block table (Flash's paged kernel,
  which takes the window); an 8-bit pool, a soft-cap or sinks take the gather path (Flash's paged
  kernel reads no 8-bit K/V on this torch, and varlen_attn has no soft-cap or sinks).

`sdpa_paged_attention` (gather + SDPA per sequence) also stays as a test oracle.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvcache.quant import dequantize, quantize
from models.attention import AttentionVariant, causal_mask, reference_attention
from models.native.probe import attention_backend

_LIB = torch.library.Library("attnserve", "DEF")
_LIB.define(
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, SymInt max_query_len, SymInt max_seq_len, "
    "float scale, float k_scale=1.0, float v_scale=1.0, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor"
)


@torch.library.register_fake("attnserve::paged_attention")
def _fake(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
          max_query_len, max_seq_len, scale, k_scale=1.0, v_scale=1.0, window=0, softcap=0.0, sinks=None):
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
                         max_query_len, max_seq_len, scale, k_scale=1.0, v_scale=1.0, window=0, softcap=0.0,
                         sinks=None) -> torch.Tensor:
    """The gather path: each sequence's K/V copied out of the pool, then one SDPA call each.

    With a window only the blocks from the first query's window start on are gathered: the keys
    are then a suffix of the sequence, so the bottom-right aligned causal (window) mask still
    holds. SDPA has no soft-cap or sinks: those steps take the written-out formula, in fp32."""
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    out = torch.empty_like(q)  # (T, H, D)
    bs, gqa = k_cache.shape[1], k_cache.shape[2] != q.shape[1]
    variant = AttentionVariant(scale, window or None, softcap or None)
    written_out = softcap > 0 or sinks is not None
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, total in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        nq = e - s
        # NOTE: the first block gathered holds the first query's window start: none before it is read
        first = max(0, total - nq - window + 1) // bs if window > 0 else 0
        num_keys = total - first * bs  # keys gathered: positions first * bs .. total - 1
        qi = q[s:e].transpose(0, 1).unsqueeze(0)  # (1, H, Sq, D)
        ids = block_tables[i, first: -(-total // bs)].long()
        ki = _gather(k_cache, ids, num_keys, q.dtype, k_scale)  # (1, Hkv, L, D)
        vi = _gather(v_cache, ids, num_keys, q.dtype, v_scale)
        if written_out:
            oi, _ = reference_attention(qi.float(), ki.float(), vi.float(), variant=variant, sinks=sinks)
        else:
            mask = None
            if window > 0 or 1 < nq < num_keys:  # queries are the last Sq of L positions: bottom-right causal
                mask = causal_mask(nq, num_keys, q.device, variant.window) == 0  # (Sq, L) True = may see
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None and nq > 1,
                                                scale=scale, enable_gqa=gqa)
        out[s:e] = oi.squeeze(0).transpose(0, 1).to(q.dtype)  # (Sq, H, D)
    return out


def _varlen_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                            max_query_len, max_seq_len, scale, k_scale=1.0, v_scale=1.0, window=0, softcap=0.0,
                            sinks=None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 - CUDA's path only

    if k_cache.dtype != q.dtype or softcap > 0 or sinks is not None:
        return sdpa_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                    query_start_loc, max_query_len, max_seq_len, scale, k_scale, v_scale,
                                    window, softcap, sinks)

    write_kv(k, v, k_cache, v_cache, slot_mapping)
    cu_seq_k = F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    # NOTE: Flash's left window counts the keys before the query's own: `window` keys in all
    left = window - 1 if window > 0 else -1
    return varlen_attn(q, k_cache, v_cache, query_start_loc, cu_seq_k, max_query_len, max_seq_len, scale=scale,
                       window_size=(left, 0), enable_gqa=k_cache.shape[2] != q.shape[1], seqused_k=seq_lens,
                       block_table=block_tables)


@functools.cache
def cpu_backend() -> str:
    """Register the CPU implementation, on first use (a pool on the CPU asks): "native-<ISA level>"
    (the C++ kernel) or "sdpa" (the gather path: no compiler, or ATTNSERVE_NATIVE=0)."""
    backend = attention_backend()
    if backend == "sdpa":
        _LIB.impl("paged_attention", sdpa_paged_attention, "CPU")
    return backend


def __getattr__(name: str) -> str:
    # NOTE: `ops.CPU_BACKEND` is read, never set: its first read registers the CPU implementation
    if name == "CPU_BACKEND":
        return cpu_backend()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_LIB.impl("paged_attention", _varlen_paged_attention, "CUDA")
