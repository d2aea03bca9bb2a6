"""The paged-attention op against the written-out formula, storage sizing, the no-compiler
fallback, and the CUDA paged path."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcache import ops
from kvcache.paged_attention import AttentionMetadata, PagedAttention
from kvcache.storage import KVCacheSpec, PagedKVCache
from models.attention import AttentionVariant, reference_attention
from server.engine.config import parse_size
from tests.reference import hf_greedy, load_hf

pytestmark = [pytest.mark.kernel, pytest.mark.tiles]  # make test-isa runs this file again under the AVX2 cap, on the portable build and on emulated AMX tiles

ROOT = Path(__file__).resolve().parents[1]


def dense_reference(q_all, k_all, v_all):
    """q (S, H, D) against k/v (S, Hkv, D): causal reference over one whole sequence, in fp64."""
    out, _ = reference_attention(*(x.double().transpose(0, 1) for x in (q_all, k_all, v_all)))
    return out.transpose(0, 1)


def run_step(seq_lens, new_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0, device="cpu", attention=None):
    """Fill a pool with each sequence's earlier K/V (scattered blocks), run one step through the
    op, and return (output, expected) with expected from the reference over whole sequences."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, dtype, block_size), num_blocks, device)
    free = iter(torch.randperm(num_blocks, generator=g).tolist())
    tables = [[next(free) for _ in range(-(-n // block_size))] for n in seq_lens]
    qs = [torch.randn(n, heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    ks = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
    for t, k, v, total, new in zip(tables, ks, vs, seq_lens, new_lens):  # earlier steps' K/V
        for pos in range(total - new):
            cache.k[0][t[pos // block_size], pos % block_size] = k[pos].to(device)
            cache.v[0][t[pos // block_size], pos % block_size] = v[pos].to(device)
    meta = AttentionMetadata.build(new_lens, [f - n for f, n in zip(seq_lens, new_lens)], tables, block_size, device)
    q, k, v = (torch.cat([x[-n:] for x, n in zip(xs, new_lens)]).to(device) for xs in (qs, ks, vs))
    out = PagedAttention(cache, meta)(0, q, k, v) if attention is None else attention(cache, meta, q, k, v)
    expected = torch.cat([dense_reference(qq, kk, vv)[-n:] for qq, kk, vv, n in zip(qs, ks, vs, new_lens)])
    for t, k, total in zip(tables, ks, seq_lens):  # the step's K/V landed in their slots
        assert torch.equal(cache.k[0][t[(total - 1) // block_size], (total - 1) % block_size].cpu(), k[total - 1])
    return out.cpu(), expected


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (9, 3)])
def test_mixed_step_matches_reference(heads, kv_heads):
    """Decodes of ragged lengths, a chunk over a cached prefix and a fresh prompt, in one call."""
    seq_lens = [7, 13, 40, 11, 6, 1]
    new_lens = [1, 1, 1, 5, 6, 1]  # three decodes, a chunk after 6 cached tokens, a fresh prompt, a 1-token prompt
    out, expected = run_step(seq_lens, new_lens, heads, kv_heads, 16, 4, torch.float32)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("length", [1, 15, 16, 17, 31, 32, 33])
@pytest.mark.parametrize("new", ["decode", "prefill", "chunk"])
def test_block_boundaries_and_a_one_token_context(length, new):
    """Sequences ending just before, on and after a block edge (block size 16), and of one token."""
    query = {"decode": 1, "prefill": length, "chunk": max(1, length // 2)}[new]
    out, expected = run_step([length, length + 3], [query, min(query, length + 3)], 9, 3, 64, 16, torch.float32,
                             seed=length)
    assert (out.double() - expected).abs().max() < 1e-5


# 48 and 200 have no code of their own: they pad up to 64 and 256 (the kernel's HeadDimSteps)
@pytest.mark.parametrize("head_dim", [8, 24, 48, 64, 80, 128, 200, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_with_and_without_padding_lanes(head_dim, dtype):
    out, expected = run_step([37, 20, 9], [1, 20, 4], 4, 2, head_dim, 8, dtype, seed=head_dim)
    assert (out.double() - expected).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_many_decodes_take_whole_block_rows():
    """Enough decodes that each one's KV heads form one work item (the whole-row path)."""
    seq_lens = [5 + 37 * i % 200 for i in range(24)]
    out, expected = run_step(seq_lens, [1] * 24, 9, 3, 64, 16, torch.float32, seed=7)
    assert (out.double() - expected).abs().max() < 1e-5


def test_bfloat16_matches_the_reference_to_bf16_precision():
    out, expected = run_step([70, 33, 18, 5], [1, 33, 6, 1], 9, 3, 64, 16, torch.bfloat16, seed=3)
    assert (out.double() - expected).abs().max() < 2e-2


def test_kernel_equals_the_sdpa_gather_path():
    """The C++ kernel against the path it replaced (kept as the fallback and as an oracle)."""
    def sdpa(cache, meta, q, k, v):
        return ops.sdpa_paged_attention(q, k, v, cache.k[0], cache.v[0], meta.slot_mapping, meta.block_tables,
                                        meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                                        meta.max_seq_len, 1 / math.sqrt(q.shape[-1]))
    lens, new = [50, 17, 64, 9], [1, 17, 30, 1]
    ours, _ = run_step(lens, new, 8, 2, 32, 16, torch.float32, seed=11)
    theirs, _ = run_step(lens, new, 8, 2, 32, 16, torch.float32, seed=11, attention=sdpa)
    assert (ours - theirs).abs().max() < 1e-5


# (compute dtype, pool dtype) and (window, softcap, sinks): every path a row can take through the kernel
POOLS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
         (torch.float32, torch.float8_e5m2)]
VARIANTS = {"plain": (0, 0.0, False), "window": (20, 0.0, False), "softcap": (0, 1.5, False), "sinks": (0, 0.0, True)}


@pytest.mark.parametrize("dtype,pool", POOLS, ids=lambda x: str(x).split(".")[-1])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_row_is_the_same_bit_for_bit_whatever_else_is_in_the_call(dtype, pool, variant):
    """Batch invariance: a query row's output, computed alone as a decode, equals that row computed
    among M = 1..64 new rows of its sequence (speculative verification, a prefill chunk, a prompt after
    a prefix-cache hit) and beside other sequences (alone, and enough decodes to take whole block rows)."""
    window, softcap, with_sinks = VARIANTS[variant]
    heads, kv_heads, head_dim, bs, context, longest = 9, 3, 64, 16, 45, 64
    total = context + longest
    g = torch.Generator().manual_seed(7)
    num_blocks = 64
    cache = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, pool, bs), num_blocks, "cpu")
    table = torch.randperm(num_blocks, generator=g)[: -(-total // bs)].tolist()
    q = torch.randn(total, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g) if with_sinks else None
    others = [[b] for b in range(num_blocks) if b not in table][:5]  # other sequences: one block, 9 keys each
    k_other, v_other = (torch.randn(9, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    q_other = torch.randn(9, heads, head_dim, generator=g).to(dtype)

    def attend(new_lens, context_lens, tables, qs, ks, vs):
        meta = AttentionMetadata.build(new_lens, context_lens, tables, bs, "cpu")
        return PagedAttention(cache, meta)(0, qs, ks, vs, AttentionVariant(1 / 8, window or None, softcap or None),
                                           sinks)

    for other in others:  # the other sequences' 8 earlier keys
        attend([8], [0], [other], q_other[:8], k_other[:8], v_other[:8])
    whole = attend([total], [0], [table], q, k, v)  # the prompt in one call, filling the pool
    alone = torch.stack([attend([1], [p], [table], q[p:p + 1], k[p:p + 1], v[p:p + 1])[0] for p in range(total)])
    assert torch.equal(whole, alone)
    for m in range(1, longest + 1):
        rows = attend([m], [context], [table], q[context:context + m], k[context:context + m], v[context:context + m])
        assert torch.equal(rows, alone[context:context + m]), m
    for num_others in (1, len(others)):  # beside decodes: one head per work item, then whole block rows
        lens = [4] + [1] * num_others
        out = attend(lens, [context] + [8] * num_others, [table] + others[:num_others],
                     torch.cat([q[context:context + 4], q_other[8:9].expand(num_others, -1, -1)]),
                     torch.cat([k[context:context + 4], k_other[8:9].expand(num_others, -1, -1)]),
                     torch.cat([v[context:context + 4], v_other[8:9].expand(num_others, -1, -1)]))
        assert torch.equal(out[:4], alone[context:context + 4])
        assert all(torch.equal(out[4 + i], out[4]) for i in range(num_others))  # the same decode, whatever its item


def test_metadata_slots_and_tables():
    meta = AttentionMetadata.build([1, 3], [5, 0], [[7, 2], [4]], block_size=4)
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0]] and meta.block_tables.dtype == torch.int32
    assert meta.seq_lens.tolist() == [6, 3] and meta.query_start_loc.tolist() == [0, 1, 4]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 6)


def test_native_kernel_is_the_cpu_backend_here():
    """This machine has a compiler: the C++ kernel built for its ISA level (under any cap the
    environment sets), not the fallback, serves CPU attention."""
    from models.native.cpu_features import machine_isa

    assert ops.CPU_BACKEND == f"native-{machine_isa()}"


@pytest.mark.fallback
def test_without_a_compiler_the_engine_serves_on_fallbacks_with_warnings(tmp_path, tiny_checkpoints):
    """No C++ compiler: attention takes the gather + SDPA path and the model step runs eagerly
    (inductor needs a compiler too); both say so, and greedy tokens are unchanged."""
    path = tiny_checkpoints["llama"]
    code = ("import warnings, torch; warnings.simplefilter('always')\n"
            "from kvcache import ops\n"
            "from server.engine import EngineConfig, LLMEngine, SamplingParams\n"
            "from tests.test_paged_attention import run_step\n"
            "out, expected = run_step([9, 4], [1, 4], 4, 2, 16, 4, torch.float32)\n"
            f"e = LLMEngine(EngineConfig(model={str(path)!r}, dtype='float32', num_blocks=32, block_size=4))\n"
            "r = e.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))\n"
            "print(ops.CPU_BACKEND, float((out.double() - expected).abs().max()), e.runner.forward is e.model,\n"
            "      ','.join(map(str, r[0][0].token_ids)))\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(CXX=str(tmp_path / "no-such-g++"), ATTNSERVE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    backend, err, eager, tokens = proc.stdout.split()
    assert backend == "sdpa" and float(err) < 1e-5 and eager == "True"
    assert "paged-attention kernel is unavailable" in proc.stderr and "no C++ compiler" in proc.stderr
    assert "running it eagerly" in proc.stderr
    assert [int(t) for t in tokens.split(",")] == hf_greedy(load_hf(path), [5, 6, 7, 8, 9], 8)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Flash paged kernel (varlen_attn)")
def test_cuda_paged_attention_uses_flash_varlen_with_block_table():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, expected = run_step([40, 3, 20, 21], [1, 1, 20, 9], 8, 2, 64, 256, torch.bfloat16, device="cuda")
    names = {e.name for e in prof.events()}
    assert any("flash_attention" in n for n in names), sorted(n for n in names if "attention" in n)
    assert not any(n == "aten::index_select" for n in names)  # no gather: the kernel reads the blocks
    assert (out.double() - expected).abs().max() < 3e-2
