"""One layer of the default model's paged attention (9 heads, 3 KV heads, head_dim 64) on this CPU's
C++ kernel (kvcache/csrc/paged_attention.cpp), per case and dtype: decodes, a speculative
verification and a prefill. A benchmark, not a test; medians of --repeats.

    python loadtests/bench_attention.py [--repeats 7]
    ATTNSERVE_CPU_ISA=avx2 python loadtests/bench_attention.py

To compare two versions of the kernel, run it on each (its library is rebuilt when the source changes).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()  # NOTE: before torch

import torch  # noqa: E402

from kvcache import ops  # noqa: E402
from kvcache.paged_attention import AttentionMetadata, PagedAttention  # noqa: E402
from kvcache.storage import KVCacheSpec, PagedKVCache  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (name, sequences, keys per sequence, new tokens per sequence)
CASES = [("decode 1 x 128 keys", 1, 128, 1), ("decode 1 x 1024 keys", 1, 1024, 1),
         ("decode 32 x 1024 keys", 32, 1024, 1), ("verify 4 x 4 rows of 1024", 4, 1024, 4),
         ("prefill 1 x 1024", 1, 1024, 1024)]


def time_case(dtype: torch.dtype, num_seqs: int, keys: int, new: int, repeats: int) -> float:
    """Median milliseconds of one call over a pool of random K/V."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-keys // BLOCK)
    cache = PagedKVCache(KVCacheSpec(1, KV_HEADS, HEAD_DIM, dtype, BLOCK), num_seqs * per_seq, "cpu")
    for pool in (cache.k[0], cache.v[0]):
        pool.copy_(torch.randn(pool.shape, generator=g).to(dtype))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    attention = PagedAttention(cache, AttentionMetadata.build([new] * num_seqs, [keys - new] * num_seqs, tables, BLOCK))
    q = torch.randn(num_seqs * new, HEADS, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(num_seqs * new, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    attention(0, q, k, v)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        attention(0, q, k, v)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"backend={ops.CPU_BACKEND} threads={torch.get_num_threads()}")
    print("| case | fp32 ms | bf16 ms |\n|---|---:|---:|")
    for name, num_seqs, keys, new in CASES:
        fp32, bf16 = (time_case(dt, num_seqs, keys, new, args.repeats) for dt in (torch.float32, torch.bfloat16))
        print(f"| {name} | {fp32:.3f} | {bf16:.3f} |")


if __name__ == "__main__":
    main()
