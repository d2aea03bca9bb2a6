"""Attention variants (sliding window, logit soft-cap, learned sinks, query pre-scale), issue 23.

The written-out oracle (`reference_attention`) against HF transformers' own eager attention; then
the paged op, the C++ kernel and the gather path, against the oracle over whole sequences. The
keys before each sequence's window are NaN and the table points those blocks at a stale block
(NaN too, or one far outside the pool): the outputs stay exact, so no path reads them.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from transformers.masking_utils import eager_mask, sliding_window_causal_mask_function
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gpt_oss import modeling_gpt_oss

from kvcache import ops
from kvcache.paged_attention import AttentionMetadata, PagedAttention
from kvcache.quant import KVScales, dequantize, quantize
from kvcache.storage import KVCacheSpec, PagedKVCache
from models.attention import AttentionVariant, reference_attention

pytestmark = [pytest.mark.kernel, pytest.mark.tiles]  # make test-isa runs this file again under the AVX2 cap, on the portable build and on emulated AMX tiles

ROOT = Path(__file__).resolve().parents[1]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


# ---------------------------------------------------------------- the oracle against HF's eager attention

def qkv(batch, heads, kv_heads, sq, sk, head_dim, seed, q_gain=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, sq, head_dim, generator=g) * q_gain  # (B, H, Sq, D)
    k = torch.randn(batch, kv_heads, sk, head_dim, generator=g)  # (B, Hkv, Sk, D)
    v = torch.randn(batch, kv_heads, sk, head_dim, generator=g)
    return q, k, v


def hf_mask(sq, sk, window):
    """transformers' own sliding-window causal mask; the queries are the last sq of sk positions."""
    return eager_mask(batch_size=2, q_length=sq, kv_length=sk, q_offset=sk - sq,
                      mask_function=sliding_window_causal_mask_function(window))  # (B, 1, Sq, Sk)


def gemma2_attention(heads, kv_heads, head_dim, window, softcap=None, pre_scale=None):
    cfg = T.Gemma2Config(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, query_pre_attn_scalar=pre_scale or head_dim,
                         attn_logit_softcapping=softcap, sliding_window=window)
    return modeling_gemma2.Gemma2Attention(cfg, layer_idx=0).eval()  # layer 0 slides


@pytest.mark.parametrize("window", [1, 3, 16, 100])
@pytest.mark.parametrize("sq,sk", [(12, 12), (5, 20), (1, 30)])  # a prompt, a chunk over cached keys, a decode
def test_oracle_window_equals_transformers_sliding_window(window, sq, sk):
    attn = gemma2_attention(8, 2, 16, window)
    assert attn.sliding_window == window
    q, k, v = qkv(2, 8, 2, sq, sk, 16, seed=window + sk)
    want, want_w = modeling_gemma2.eager_attention_forward(attn, q, k, v, hf_mask(sq, sk, window), scaling=attn.scaling)
    got, got_w = reference_attention(q, k, v, variant=AttentionVariant(attn.scaling, window))
    assert (got.transpose(1, 2) - want).abs().max() < 1e-5  # HF's is (B, S, H, D)
    assert (got_w - want_w).abs().max() < 1e-6
    if window < sk:  # the window did cut keys: plain causal attention differs
        plain, _ = reference_attention(q, k, v, variant=AttentionVariant(attn.scaling))
        assert (plain - got).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (4, 1)])
def test_oracle_softcap_and_query_pre_scale_equal_gemma2_eager(window, heads, kv_heads):
    """Gemma 2: scores scaled by query_pre_attn_scalar^-1/2 (not head_dim's), then soft-capped, then masked."""
    attn = gemma2_attention(heads, kv_heads, 16, window or 10_000, softcap=2.0, pre_scale=24)
    assert attn.scaling == 24 ** -0.5 and attn.attn_logit_softcapping == 2.0
    q, k, v = qkv(2, heads, kv_heads, 6, 14, 16, seed=heads, q_gain=3.0)  # scores well past the cap
    want, want_w = modeling_gemma2.eager_attention_forward(attn, q, k, v, hf_mask(6, 14, window or 10_000),
                                                           scaling=attn.scaling, softcap=attn.attn_logit_softcapping)
    variant = AttentionVariant(24 ** -0.5, window, 2.0)
    got, got_w = reference_attention(q, k, v, variant=variant)
    assert (got.transpose(1, 2) - want).abs().max() < 1e-5
    assert (got_w - want_w).abs().max() < 1e-6
    uncapped, _ = reference_attention(q, k, v, variant=AttentionVariant(24 ** -0.5, window))
    assert (uncapped - got).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sq,sk", [(9, 9), (4, 17), (1, 17)])
def test_oracle_sinks_equal_gpt_oss_eager(window, sq, sk):
    """gpt-oss: one learned logit per head joins each row's softmax and is dropped after it."""
    cfg = T.GptOssConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         sliding_window=window or 10_000)
    attn = modeling_gpt_oss.GptOssAttention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        attn.sinks.copy_(torch.linspace(-3.0, 4.0, 8))  # from negligible to most of the mass
    q, k, v = qkv(2, 8, 2, sq, sk, 16, seed=sk)
    want, want_w = modeling_gpt_oss.eager_attention_forward(attn, q, k, v, hf_mask(sq, sk, window or 10_000),
                                                            scaling=attn.scaling)
    got, got_w = reference_attention(q, k, v, variant=AttentionVariant(attn.scaling, window), sinks=attn.sinks.detach())
    assert (got.transpose(1, 2) - want).abs().max() < 1e-5
    assert (got_w - want_w).abs().max() < 1e-6
    assert got_w.sum(-1).max() < 1 and got_w.sum(-1).min() < 0.5  # the sinks took mass: much, in the last heads


# ---------------------------------------------------------------- the paged op against the oracle

NAN_BLOCK = -1  # `stale`: a block of the pool holding NaN throughout


def variant_step(seq_lens, new_lens, heads, kv_heads, head_dim, block_size, variant=None, sinks=None, *,
                 dtype=torch.float32, pool=None, seed=0, attention=None, poison="keys", stale=NAN_BLOCK):
    """One step through the paged op; returns (output, expected), expected from the oracle over
    whole sequences (fp64, over the K/V as the pool stores them).

    Each sequence's earlier K/V sit in scattered blocks. Before the window of its step's first
    query, its keys are NaN (`poison="keys"`: every key, as the kernel promises; "blocks": the
    blocks wholly before it, as the gather path promises), and its table entries for the blocks
    wholly before the window hold `stale` (the engine's are another sequence's blocks, or 0).
    """
    g = torch.Generator().manual_seed(seed)
    pool = pool or dtype
    fp8 = pool in FP8
    scales = KVScales((2.0 ** -4,), (2.0 ** -6,)) if fp8 else None
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, pool, block_size), num_blocks, scales=scales)
    free = iter(torch.randperm(num_blocks, generator=g).tolist())
    tables = [[next(free) for _ in range(-(-n // block_size))] for n in seq_lens]
    nan_block = next(free)
    cache.k[0][nan_block] = float("nan")
    cache.v[0][nan_block] = float("nan")
    stale = nan_block if stale == NAN_BLOCK else stale
    qs = [torch.randn(n, heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    ks = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]

    def stored(x, scale):  # what the pool holds (and the kernel reads) for x
        return quantize(x, scale, pool) if fp8 else x
    window = variant.window if variant is not None and variant.window else 0
    for t, k, v, total, new in zip(tables, ks, vs, seq_lens, new_lens):
        start = max(0, total - new - window + 1) if window else 0  # the step's first query's window start
        dead = start if poison == "keys" else start // block_size * block_size
        for pos in range(total - new):  # earlier steps' K/V
            b, i = t[pos // block_size], pos % block_size
            cache.k[0][b, i] = float("nan") if pos < dead else stored(k[pos], cache.scales.k[0])
            cache.v[0][b, i] = float("nan") if pos < dead else stored(v[pos], cache.scales.v[0])
        t[:start // block_size] = [stale] * (start // block_size)  # NOTE: the blocks wholly before the window
    meta = AttentionMetadata.build(new_lens, [f - n for f, n in zip(seq_lens, new_lens)], tables, block_size)
    q, k, v = (torch.cat([x[-n:] for x, n in zip(xs, new_lens)]) for xs in (qs, ks, vs))
    if attention is None:
        out = PagedAttention(cache, meta)(0, q, k, v, variant, sinks)
    else:
        out = attention(cache, meta, q, k, v, variant, sinks)

    def widened(x, scale):  # (S, Hkv, D) -> (Hkv, S, D) in fp64, as stored
        x = dequantize(quantize(x, scale, pool), scale, torch.float64) if fp8 else x.double()
        return x.transpose(0, 1)
    expected = []
    for qq, kk, vv, n in zip(qs, ks, vs, new_lens):
        o, _ = reference_attention(qq.double().transpose(0, 1), widened(kk, cache.scales.k[0]),
                                   widened(vv, cache.scales.v[0]), variant=variant,
                                   sinks=None if sinks is None else sinks.double())
        expected.append(o.transpose(0, 1)[-n:])  # (n, H, D)
    return out, torch.cat(expected)


def gather_path(cache, meta, q, k, v, variant, sinks):
    """ops.sdpa_paged_attention: the CPU fallback (ATTNSERVE_NATIVE=0), and CUDA's for caps and sinks."""
    variant = variant or AttentionVariant.plain(q.shape[-1])
    return ops.sdpa_paged_attention(q, k, v, cache.k[0], cache.v[0], meta.slot_mapping, meta.block_tables,
                                    meta.seq_lens, meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                                    variant.scale, cache.scales.k[0], cache.scales.v[0], variant.window or 0,
                                    variant.softcap or 0.0, sinks)


def sinks_for(heads):
    return torch.linspace(-2.0, 3.0, heads)  # (H,) fp32: from little to most of a row's mass


def variants(head_dim, heads):
    """name -> (variant, sinks). Windows of 1, 15, 16, 17 around a block of 16, one past every sequence."""
    scale = 1 / math.sqrt(head_dim)
    return {
        "window1": (AttentionVariant(scale, 1), None),
        "window15": (AttentionVariant(scale, 15), None),
        "window16": (AttentionVariant(scale, 16), None),
        "window17": (AttentionVariant(scale, 17), None),
        "window_past_the_sequence": (AttentionVariant(scale, 500), None),
        "softcap": (AttentionVariant(scale, None, 1.5), None),
        "sinks": (AttentionVariant(scale), sinks_for(heads)),
        "pre_scale": (AttentionVariant(0.4), None),
        "all": (AttentionVariant(0.3, 17, 1.5), sinks_for(heads)),
    }


VARIANTS = list(variants(16, 4))
# three decodes of ragged lengths, a chunk over 30 cached tokens, a fresh prompt, a one-token prompt
MIXED = ([7, 40, 70, 50, 33, 1], [1, 1, 1, 20, 33, 1])


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (4, 1)])
def test_mixed_step_equals_the_oracle(name, heads, kv_heads):
    variant, sinks = variants(16, heads)[name]
    out, expected = variant_step(*MIXED, heads, kv_heads, 16, 16, variant, sinks, seed=heads)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("name", VARIANTS)
def test_one_head_per_work_item(name):
    """Two sequences: each decode's KV heads are separate work items (fewer sequences than threads x 2)."""
    variant, sinks = variants(64, 9)[name]
    out, expected = variant_step([77, 45], [1, 13], 9, 3, 64, 16, variant, sinks, seed=5)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("window", [1, 15, 16, 17])
@pytest.mark.parametrize("length", [16, 17, 32, 33, 48, 49])
@pytest.mark.parametrize("new", ["decode", "prefill", "chunk"])
def test_windows_around_block_edges(window, length, new):
    """The window's start just before, on and after a block edge (block size 16)."""
    query = {"decode": 1, "prefill": length, "chunk": max(1, length // 3)}[new]
    variant = AttentionVariant(0.125, window)
    out, expected = variant_step([length, length + 3], [query, min(query, length + 3)], 9, 3, 64, 16, variant,
                                 seed=length + window)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("head_dim", [8, 24, 80, 128])
def test_head_dims_with_and_without_padding_lanes(head_dim):
    variant, sinks = variants(head_dim, 4)["all"]
    out, expected = variant_step([37, 20, 29], [1, 20, 4], 4, 2, head_dim, 8, variant, sinks, seed=head_dim)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["window17", "softcap", "sinks", "all"])
def test_many_decodes_take_whole_block_rows(name):
    seq_lens = [5 + 37 * i % 200 for i in range(24)]
    variant, sinks = variants(64, 9)[name]
    out, expected = variant_step(seq_lens, [1] * 24, 9, 3, 64, 16, variant, sinks, seed=7)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["window16", "softcap", "sinks", "all"])
def test_bfloat16_to_bf16_precision(name):
    variant, sinks = variants(64, 9)[name]
    out, expected = variant_step([70, 50, 18, 5], [1, 33, 6, 1], 9, 3, 64, 16, variant, sinks,
                                 dtype=torch.bfloat16, seed=3)
    assert out.dtype == torch.bfloat16 and (out.double() - expected).abs().max() < 2e-2


@pytest.mark.parametrize("pool", FP8)
@pytest.mark.parametrize("q_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", ["window17", "all"])
def test_8bit_pool(pool, q_dtype, tol, name):
    """Decodes widen in place; the chunk and the prompt widen their blocks from the window's on."""
    variant, sinks = variants(64, 9)[name]
    out, expected = variant_step([70, 50, 33, 18], [1, 20, 33, 1], 9, 3, 64, 16, variant, sinks, dtype=q_dtype,
                                 pool=pool, seed=4)
    assert (out.double() - expected).abs().max() < tol


def test_variants_change_the_output():
    """The checks above can fail: each variant moves the output far past their tolerance."""
    plain, _ = variant_step(*MIXED, 9, 3, 16, 16, AttentionVariant(0.25), seed=9)
    for name, (variant, sinks) in variants(16, 9).items():
        if name in ("window_past_the_sequence", "pre_scale"):
            continue
        out, _ = variant_step(*MIXED, 9, 3, 16, 16, variant, sinks, seed=9)
        assert (out - plain).abs().max() > 0.05, name


# ---------------------------------------------------------------- the gather path

@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (4, 1)])
def test_gather_path_equals_the_oracle(name, heads, kv_heads):
    variant, sinks = variants(16, heads)[name]
    out, expected = variant_step(*MIXED, heads, kv_heads, 16, 16, variant, sinks, seed=heads, attention=gather_path,
                                 poison="blocks")
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("window", [1, 15, 16, 17])
@pytest.mark.parametrize("new", ["decode", "prefill", "chunk"])
def test_gather_path_windows_around_block_edges(window, new):
    query = {"decode": 1, "prefill": 33, "chunk": 11}[new]
    out, expected = variant_step([33, 49], [query, min(query, 49)], 9, 3, 64, 16, AttentionVariant(0.125, window),
                                 seed=window, attention=gather_path, poison="blocks")
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("pool", [torch.bfloat16, *FP8])
def test_gather_path_bf16_and_8bit(pool):
    variant, sinks = variants(64, 9)["all"]
    out, expected = variant_step([70, 50, 18, 5], [1, 33, 6, 1], 9, 3, 64, 16, variant, sinks, dtype=torch.bfloat16,
                                 pool=pool, seed=6, attention=gather_path, poison="blocks")
    assert out.dtype == torch.bfloat16 and (out.double() - expected).abs().max() < 2e-2


def test_gather_path_never_indexes_stale_blocks():
    """A stale id past the pool's end: index_select would raise had the gather touched it."""
    variant, sinks = variants(16, 9)["all"]
    out, expected = variant_step(*MIXED, 9, 3, 16, 16, variant, sinks, attention=gather_path, poison="blocks",
                                 stale=1 << 30)
    assert (out.double() - expected).abs().max() < 1e-5


def test_kernel_never_dereferences_stale_blocks():
    """A stale id 2^30 blocks past the pool (terabytes away): the kernel would crash had it read
    one, so it runs in a child, over every storage type and both query dtypes."""
    code = (
        "import torch\n"
        "from tests.test_attention_variants import variant_step, variants, MIXED\n"
        "variant, sinks = variants(64, 9)['all']\n"
        "for dtype, pool in [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float8_e4m3fn),\n"
        "                    (torch.bfloat16, torch.float8_e5m2)]:\n"
        "    out, expected = variant_step(*MIXED, 9, 3, 64, 16, variant, sinks, dtype=dtype, pool=pool,\n"
        "                                 stale=1 << 30)\n"
        "    print(float((out.double() - expected).abs().max()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=os.environ.copy(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = [float(x) for x in proc.stdout.split()]
    assert len(errs) == 4 and errs[0] < 1e-5 and errs[2] < 1e-5 and max(errs) < 2e-2


def test_kernel_equals_the_gather_path():
    """The two CPU implementations agree on one step with every variant (blocks poisoned for both)."""
    variant, sinks = variants(32, 8)["all"]
    args = ([50, 17, 64, 9], [1, 17, 30, 1], 8, 2, 32, 16, variant, sinks)
    ours, _ = variant_step(*args, seed=11, poison="blocks")
    theirs, _ = variant_step(*args, seed=11, poison="blocks", attention=gather_path)
    assert (ours - theirs).abs().max() < 1e-5


def test_the_op_checks_sinks_and_window():
    cache = PagedKVCache(KVCacheSpec(1, 2, 16, torch.float32, 16), 4)
    meta = AttentionMetadata.build([3], [0], [[1]], 16)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    with pytest.raises(RuntimeError, match="sinks"):
        PagedAttention(cache, meta)(0, q, k, v, AttentionVariant(0.25), torch.zeros(3))  # one per query head
    with pytest.raises(RuntimeError, match="window"):
        torch.ops.attnserve.paged_attention(q, k, v, cache.k[0], cache.v[0], meta.slot_mapping, meta.block_tables,
                                            meta.seq_lens, meta.query_start_loc, 3, 3, 0.25, 1.0, 1.0, -1)
