"""Paged attention against dense attention, storage sizing, and the CUDA Flash path."""
import pytest
import torch

from kvcache.paged_attention import AttentionMetadata, PagedAttention
from kvcache.storage import KVCacheSpec, PagedKVCache, parse_size
from models.attention import reference_attention


def dense_reference(q_all, k_all, v_all):
    """q (S, H, D) against k/v (S, Hkv, D): causal reference over one whole sequence."""
    out, _ = reference_attention(q_all.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1))
    return out.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_mixed_step_matches_dense(heads, kv_heads):
    """Two decodes, a prefill with a cached prefix, and a fresh prefill in one packed step."""
    g = torch.Generator().manual_seed(0)
    bs, d = 4, 8
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_dim=d, dtype=torch.float32, block_size=bs)
    cache = PagedKVCache(spec, num_blocks=32)
    full_lens = [7, 13, 11, 6]  # total tokens per sequence after this step
    new_lens = [1, 1, 5, 6]  # decode, decode, chunk after 6 cached tokens, fresh prompt
    tables = [[3, 9], [0, 5, 17, 2], [8, 1, 30], [4, 6]]
    qs = [torch.randn(n, heads, d, generator=g) for n in full_lens]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in full_lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in full_lens]
    for t, k, v, total, new in zip(tables, ks, vs, full_lens, new_lens):  # earlier steps' K/V
        for pos in range(total - new):
            cache.k[0][t[pos // bs], pos % bs] = k[pos]
            cache.v[0][t[pos // bs], pos % bs] = v[pos]
    meta = AttentionMetadata.build(new_lens, [f - n for f, n in zip(full_lens, new_lens)], tables, bs, num_decodes=2)
    q = torch.cat([x[-n:] for x, n in zip(qs, new_lens)])
    k = torch.cat([x[-n:] for x, n in zip(ks, new_lens)])
    v = torch.cat([x[-n:] for x, n in zip(vs, new_lens)])
    out = PagedAttention(cache, meta)(0, q, k, v)
    expected = torch.cat([dense_reference(qq, kk, vv)[-n:] for qq, kk, vv, n in zip(qs, ks, vs, new_lens)])
    assert (out - expected).abs().max() < 1e-5
    for t, k, total in zip(tables, ks, full_lens):  # the new K/V landed in their slots
        assert torch.equal(cache.k[0][t[(total - 1) // bs], (total - 1) % bs], k[total - 1])


def test_decodes_of_different_lengths_are_grouped_and_exact():
    g = torch.Generator().manual_seed(3)
    bs, d, heads, kv_heads = 4, 8, 4, 2
    cache = PagedKVCache(KVCacheSpec(1, kv_heads, d, torch.float32, bs), num_blocks=64)
    lens = [40, 35, 13, 11, 4, 3]  # longest first, as the scheduler orders them
    tables, free = [], iter(torch.randperm(64, generator=g).tolist())
    for n in lens:
        tables.append([next(free) for _ in range(-(-n // bs))])
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    qs = [torch.randn(n, heads, d, generator=g) for n in lens]
    for t, k, v, n in zip(tables, ks, vs, lens):
        for pos in range(n - 1):
            cache.k[0][t[pos // bs], pos % bs] = k[pos]
            cache.v[0][t[pos // bs], pos % bs] = v[pos]
    meta = AttentionMetadata.build([1] * 6, [n - 1 for n in lens], tables, bs, num_decodes=6)
    assert [(x.start, x.end) for x in meta.decode_groups] == [(0, 2), (2, 4), (4, 6)]
    out = PagedAttention(cache, meta)(0, torch.stack([q[-1] for q in qs]), torch.stack([k[-1] for k in ks]),
                                      torch.stack([v[-1] for v in vs]))
    expected = torch.stack([dense_reference(q, k, v)[-1] for q, k, v in zip(qs, ks, vs)])
    assert (out - expected).abs().max() < 1e-5


def test_slot_mapping_follows_block_tables():
    meta = AttentionMetadata.build([1, 3], [5, 0], [[7, 2], [4]], block_size=4, num_decodes=1)
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18]
    (group,) = meta.decode_groups
    assert group.block_ids.tolist() == [7, 2] and group.length == 6 and group.mask is None


def test_kv_bytes_per_token_and_gqa_fits_3x_mha():
    gqa = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    mha = KVCacheSpec(num_layers=30, num_kv_heads=9, head_dim=64, dtype=torch.bfloat16)
    mqa = KVCacheSpec(num_layers=30, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16)
    assert gqa.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    budget = 9 * mha.bytes_per_block * 100
    assert gqa.num_blocks_for(budget) == 3 * mha.num_blocks_for(budget) == 2700
    assert mqa.num_blocks_for(budget) == 9 * mha.num_blocks_for(budget)
    cache = PagedKVCache(KVCacheSpec(2, 3, 8, torch.float32, 16), num_blocks=5)
    assert cache.k[1].shape == (5, 16, 3, 8) and cache.nbytes == 5 * 16 * 2 * 2 * 3 * 8 * 4


def test_parse_size():
    assert parse_size("1GiB") == 2**30 and parse_size("512MiB") == 2**29
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size("lots")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks the Flash backend is selected")
def test_cuda_paged_attention_uses_flash_backend():
    dev, bs, d = "cuda", 16, 64
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=d, dtype=torch.bfloat16, block_size=bs)
    cache = PagedKVCache(spec, num_blocks=16, device=dev)
    cache_cpu = PagedKVCache(KVCacheSpec(1, 2, d, torch.float32, bs), num_blocks=16)
    g = torch.Generator().manual_seed(0)
    prior = torch.randn(2, 16, bs, 2, d, generator=g)
    cache.k[0].copy_(prior[0].to(dev, torch.bfloat16))
    cache.v[0].copy_(prior[1].to(dev, torch.bfloat16))
    cache_cpu.k[0].copy_(cache.k[0].float().cpu())
    cache_cpu.v[0].copy_(cache.v[0].float().cpu())
    new, ctx, tables = [1, 1, 20, 9], [40, 3, 0, 12], [[0, 1, 2], [3], [4, 5], [6, 7]]
    q = torch.randn(sum(new), 8, d, generator=g)
    k = torch.randn(sum(new), 2, d, generator=g)
    v = torch.randn(sum(new), 2, d, generator=g)
    meta = AttentionMetadata.build(new, ctx, tables, bs, num_decodes=2, device=dev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = PagedAttention(cache, meta)(0, *(x.to(dev, torch.bfloat16) for x in (q, k, v)))
    names = {e.name for e in prof.events()}
    assert any("flash_attention" in n for n in names), sorted(n for n in names if "attention" in n)
    assert not any("efficient_attention" in n or n == "aten::_scaled_dot_product_attention_math" for n in names)
    ref = PagedAttention(cache_cpu, AttentionMetadata.build(new, ctx, tables, bs, num_decodes=2))(0, q, k, v)
    assert (out.float().cpu() - ref).abs().max() < 3e-2
