"""One GGUF matrix on the 8-bit-activation kernel in its file's own form against the per-group form it replaced.

    python loadtests/bench_gguf_forms.py --types Q4_K,Q5_K,Q6_K --rows 65536 --tokens 1,8,32,512
    ATTNSERVE_CPU_ISA=avx2 python loadtests/bench_gguf_forms.py --against exact --types Q6_K,IQ4_XS,Q5_K --rows 32768

`--against exact`: the own form against the exact kernel (models/csrc/quant_linear.cpp, fp32 x: the decoded codes,
8 bits for Q5_K, Q6_K and IQ4) instead, what `--activations auto` chooses between (models/native/cpu_path.py).

The own form: K-quant scales as superblock records and 5- and 6-bit codes in their own bits
(models/csrc/group_scales.h, code_planes.h); the per-group form: the codes' decoded width (4 or 8 bits) with a
fp32 (or exact fp16) scale and offset per group. Both give the same weights bit for bit. A matrix of --rows x
2,048 random blocks (65,536 rows: beyond a 32 MiB L3, as a 1B-8B model's matrices stream from DRAM), bf16
activations, medians of --repeats alternating runs. A benchmark, not a test: it prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from models.native.libraries import load  # noqa: E402
from models.quant_formats import from_gguf  # noqa: E402
from models.quant_linear import packed_bits  # noqa: E402
from tests.random_gguf import random_blocks  # noqa: E402

K = 2048


def forms(kind: T, rows: int, against: str) -> dict:
    w = from_gguf(random_blocks(np.random.default_rng(0), kind, rows, K, signed=kind not in (T.Q4_K, T.Q5_K)),
                  kind, (rows, K))
    own_bits = packed_bits(w, True)
    old = (torch.ops.attnserve.pack_quant(w.q, w.scale, w.offset, w.bits, w.group_size) if against == "exact" else
           torch.ops.attnserve.pack_q8(w.q, w.scale, w.offset, w.bits, w.group_size))
    return {
        against: (old, w.bits, w.group_size, against == "exact"),
        "own": (torch.ops.attnserve.pack_q8(w.q, w.scale, w.offset, own_bits, w.group_size, w.superblocks),
                own_bits, w.group_size, False),
    }


def ms(packed, x: torch.Tensor, rows: int) -> float:
    tensors, bits, group, exact = packed
    op = torch.ops.attnserve.quant_linear if exact else torch.ops.attnserve.q8_linear
    calls = max(3, 200 // x.shape[0])
    for _ in range(2):
        op(x, *tensors, None, bits, group, rows)
    start = time.perf_counter()
    for _ in range(calls):
        op(x, *tensors, None, bits, group, rows)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q3_K,IQ4_XS")
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--tokens", default="1,8,32,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--against", choices=("per-group", "exact"), default="per-group")
    args = ap.parse_args()
    load("q8_linear")
    load("quant_linear")
    torch.set_num_threads(args.threads)
    a = args.against
    print(f"{'type':<8}{'M':>5}{a + ' MB':>14}{'own MB':>8}{a + ' ms':>14}{'own ms':>9}{'own / ' + a:>17}")
    for name in args.types.split(","):
        packed = forms(T[name], args.rows, a)
        size = {k: sum(t.numel() * t.element_size() for t in v[0]) / 1e6 for k, v in packed.items()}
        for m in map(int, args.tokens.split(",")):
            # NOTE: bf16 x as a decode step's; the exact kernel takes it in fp32 (its dtype under the AVX2 cap)
            x = torch.randn(m, K).bfloat16() if a == "per-group" else torch.randn(m, K)
            times = {k: [] for k in packed}
            for _ in range(args.repeats):
                for k, p in packed.items():
                    times[k].append(ms(p, x, args.rows))
            old, own = (statistics.median(times[k]) for k in (a, "own"))
            print(f"{name:<8}{m:>5}{size[a]:>14.1f}{size['own']:>8.1f}{old:>14.3f}{own:>9.3f}{own / old:>17.2f}")


if __name__ == "__main__":
    main()
