"""The quantized linears (models/csrc/quant_linear.cpp exact, q8_linear.cpp int8 activations) at M rows
on three of the default model's shapes (gate_up 576->1536, down 1536->576, a sixth of the LM head
576->8192), Q4_1 and Q8_0, fp32 and bf16 activations: GFLOP/s, medians of --repeats. Smaller than
bench_linear.py, so that two builds can be run alternately (the machine's noise moves whole runs). A
benchmark, not a test.

    python loadtests/bench_quant_rows.py [--rows 1,8,32,512] [--repeats 15]
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

from models.quant_formats import QuantizedTensor  # noqa: E402
from models.quant_linear import QuantLinear  # noqa: E402

SHAPES = [(1536, 576), (576, 1536), (8192, 576)]  # (out, in)
FORMATS = {"Q4_1": (4, True), "Q8_0": (8, False)}  # bits, offsets; fp16 scales, groups of 32


def random_weight(n: int, k: int, bits: int, offsets: bool) -> QuantizedTensor:
    g = torch.Generator().manual_seed(n + k)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    offset = (torch.randn(n, k // 32, generator=g) * 0.02).half().float() if offsets else None
    return QuantizedTensor(q, scale, offset, bits, 32, "bench")


def gflops(layers: list[QuantLinear], m: int, dtype: torch.dtype, repeats: int) -> float:
    xs = [torch.randn(m, layer.in_features).to(dtype) for layer in layers]
    for layer, x in zip(layers, xs):  # warm-up
        layer(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer, x in zip(layers, xs):
            layer(x)
        times.append(time.perf_counter() - start)
    return sum(2 * m * layer.in_features * layer.out_features for layer in layers) / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,512")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    print(f"threads={torch.get_num_threads()}\n| weights | activations | dtype | " + " | ".join(f"M={m}" for m in rows)
          + " |\n|---|---|---|" + "---:|" * len(rows))
    for fmt, (bits, offsets) in FORMATS.items():
        weights = [random_weight(n, k, bits, offsets) for n, k in SHAPES]
        for activations in ("exact", "int8"):
            for dtype in (torch.float32, torch.bfloat16):
                layers = [QuantLinear(w, None, dtype, activations=activations) for w in weights]
                figures = [gflops(layers, m, dtype, args.repeats if m < 512 else max(3, args.repeats // 3))
                           for m in rows]
                print(f"| {fmt} | {activations} | {str(dtype).removeprefix('torch.')} | "
                      + " | ".join(f"{f:.1f}" for f in figures) + " |")


if __name__ == "__main__":
    main()
