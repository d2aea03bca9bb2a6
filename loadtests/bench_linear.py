"""The linear paths models/native/cpu_path.py chooses between, measured on this CPU (and level).

    python loadtests/bench_linear.py                          # this CPU
    ATTNSERVE_CPU_ISA=avx2 python loadtests/bench_linear.py   # as on an AVX2-only CPU

For the default model's linear shapes (qkv 576->960, o 576->576, gate/up 576->3072, down
1536->576, all 30 layers, then the 576->49152 LM head) it times one pass over every weight, as a
step does, at several token counts M, for each candidate this CPU runs:

  fp32 F.linear      fp32 weights, torch's matmul (MKL)
  fp32 oneDNN        fp32 weights reordered for oneDNN (the `onednn` path in fp32)
  bf16 F.linear      bf16 weights and activations, torch's matmul
  bf16 oneDNN        bf16 weights reordered for oneDNN (`onednn` in bf16; refused below AVX-512)
  panels fp32        bf16 weights in panels, widened in registers; fp32 activations (`panels`)
  panels bf16        the same panels, bf16 activations: bf16 pair dot products on AVX512-BF16
                     builds, widened to fp32 elsewhere (`panels` in bf16)
and, for quantized weights (--quantized), torch's own CPU kernels against ours
(models/csrc/quant_linear.cpp), each with fp32 and bf16 activations:
  int8 torch         `_weight_int8pack_mm`: int8 weights, one scale per output channel
  int4 torch         `_weight_int4pack_mm_for_cpu`: int4 in groups of 32, bf16 scales and zeros
  int8 ours          our kernel on the same int8 weights (`--quantization int8`)
  Q8_0 / Q4_1 ours   our kernel on a GGUF's formats: int8 / int4 codes in groups of 32, fp16 scales
  Q8_0 / Q4_1 x8     the same weights with 8-bit activations (models/csrc/q8_linear.cpp: x rounded
                     to int8 per block of 32, integer dot products)
  ... x8 prompt      the same op with every row a prompt row: at the amx level the codes dequantized
                     to bf16 per call on bf16 tiles (what prompt tokens take), elsewhere the x8 rows

and prints GFLOP/s, and the milliseconds of one pass at the smallest M (a batch-1 decode step's
linears). Medians of --repeats.
A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

ISA = apply_isa_cap()  # NOTE: before torch
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.native.libraries import load  # noqa: E402
from models.native.probe import onednn_packs  # noqa: E402

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]


def candidates(weights: list[torch.Tensor]) -> dict:
    """name -> (activation dtype, one call per weight)."""
    out = {}
    fp32 = [w.float() for w in weights]
    out["fp32 F.linear"] = (torch.float32, [lambda x, w=w: F.linear(x, w) for w in fp32])
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in fp32]
    out["fp32 oneDNN"] = (torch.float32, [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                          for p in packed])
    out["bf16 F.linear"] = (torch.bfloat16, [lambda x, w=w: F.linear(x, w) for w in weights])
    if onednn_packs(torch.bfloat16):
        packed16 = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        out["bf16 oneDNN"] = (torch.bfloat16, [
            lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed16])
    load("panel_linear")
    panels = [torch.ops.attnserve.pack_panels(w) for w in weights]
    calls = [lambda x, p=p, n=w.shape[0]: torch.ops.attnserve.panel_linear(x, p, None, n) for p, w in zip(panels, weights)]
    out["panels fp32"] = (torch.float32, calls)
    out["panels bf16"] = (torch.bfloat16, calls)
    return out


def quantized_candidates(weights: list[torch.Tensor]) -> dict:
    """torch's int8 / int4 CPU kernels and ours, on weights quantized from the same bf16 ones."""
    from models.quant_formats import QuantizedTensor, quantize_rtn
    from models.quant_linear import QuantLinear

    int8 = [quantize_rtn(w, "int8") for w in weights]
    int4 = [quantize_rtn(w, "int4") for w in weights]
    out = {}
    for dtype, suffix in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        calls = [lambda x, q=q.q, s=q.scale.reshape(-1).to(dtype): torch.ops.aten._weight_int8pack_mm(x, q, s)
                 for q in int8]
        out[f"int8 torch {suffix}"] = (dtype, calls)
        calls = []
        for q in int4:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.q.to(torch.int32), 1)
            # NOTE: torch's int4 computes (q - 8) * scale + zero
            zeros = torch.stack([q.scale, q.offset + 8 * q.scale], -1).transpose(0, 1).contiguous().to(dtype)
            calls.append(lambda x, p=packed, z=zeros: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, z))
        out[f"int4 torch {suffix}"] = (dtype, calls)
    fp16 = lambda q: QuantizedTensor(q.q, q.scale.half().float(), None if q.offset is None else  # noqa: E731
                                     q.offset.half().float(), q.bits, 32, q.kind)
    q8_0 = [fp16(QuantizedTensor(q.q, q.scale.expand(-1, q.shape[1] // 32).contiguous(), None, 8, 32, "Q8_0"))
            for q in int8]
    for name, quantized in (("int8 ours", int8), ("Q8_0 ours", q8_0), ("Q4_1 ours", [fp16(q) for q in int4])):
        layers = [QuantLinear(q, None, torch.float32) for q in quantized]
        out[f"{name} fp32"] = (torch.float32, layers)
        out[f"{name} bf16"] = (torch.bfloat16, layers)
    for name, quantized in (("Q8_0 x8", q8_0), ("Q4_1 x8", [fp16(q) for q in int4])):
        layers = [QuantLinear(q, None, torch.float32, activations="int8") for q in quantized]
        out[f"{name} fp32"] = (torch.float32, layers)
        out[f"{name} bf16"] = (torch.bfloat16, layers)
        # every row a prompt row: on bf16 tiles in the amx build (the int8 kernel elsewhere)
        prompt = [lambda x, m=m: torch.ops.attnserve.q8_linear(
            x, m.codes, m.scales, m.offsets, None, m.bits, m.group_size, m.out_features,
            torch.ones(x.shape[0], dtype=torch.bool)) for m in layers]
        out[f"{name} prompt bf16"] = (torch.bfloat16, prompt)
    return out


def time_pass(calls, inputs, repeats: int) -> float:
    def one():
        for call, x in zip(calls, inputs):
            call(x)
    one()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        one()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32,512", help="token counts M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quantized", action="store_true", help="int8 / int4 kernels: torch's and ours")
    ap.add_argument("--slow-limit", type=float, default=20.0, help="skip a candidate at larger M once one pass takes this many s")
    ap.add_argument("--only", help="only the candidates whose name contains this (e.g. x8: the 8-bit-activation ones)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).bfloat16() for n, k in SHAPES]
    flops_per_token = 2 * sum(n * k for n, k in SHAPES)
    weight_bytes = sum(n * k for n, k in SHAPES) * 2
    print(f"isa={ISA} torch capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; "
          f"one pass = {len(SHAPES)} linears, {weight_bytes / 1e6:.0f} MB of bf16 weights")
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"{'path':<16}" + "".join(f"{f'M={m} GFLOP/s':>16}" for m in tokens) + f"{f'M={tokens[0]} ms/pass':>16}")
    for name, (dtype, calls) in (quantized_candidates if args.quantized else candidates)(weights).items():
        if args.only and args.only not in name:
            continue
        row, slow, first = f"{name:<16}", False, None
        for m in tokens:
            if slow:
                row += f"{'-':>16}"
                continue
            inputs = [torch.randn(m, k, generator=g).to(dtype) for _, k in SHAPES]
            seconds = time_pass(calls, inputs, args.repeats)
            slow = seconds > args.slow_limit / args.repeats
            row += f"{flops_per_token * m / seconds / 1e9:>16.1f}"
            first = seconds if first is None else first
        print(row + f"{first * 1e3:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
