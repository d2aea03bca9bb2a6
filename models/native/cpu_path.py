"""The one place that decides how an engine computes on this CPU, once, at start.

`choose_cpu_path` is a pure function of what the machine can do (`CpuCapabilities`: the ISA
level, what oneDNN packs, whether our C++ kernels built) and what was asked for; `probe.detect`
gathers those facts. The choices, measured on an AVX2-only and an AVX512-BF16 CPU
(docs/benchmarks.md, "Choosing the CPU path"):

* dtype `auto`: bf16 where the CPU has bf16 arithmetic (AVX512-BF16) and the checkpoint is 16-bit;
  float32 otherwise (where bf16 matmul is emulated: several times slower than fp32).
* linears: bf16 weights in our panels (`panels`, models/csrc/linear.cpp) wherever the weights are
  bf16 values: bf16 pair dot products where the CPU has them (faster than oneDNN's bf16 at decode,
  within 15% of it at prefill), else widened to fp32 in registers (as fast as oneDNN's fp32 at prefill, half
  the bytes at decode); oneDNN's packed kernels otherwise (fp32 weights, or no C++ compiler).
* at the amx level (AMX's tiles granted: tiles.py), bf16 linears in oneDNN's packed matmuls, which run
  them on the tiles (`amx-bf16`): on an AMX Xeon oneDNN's bf16 beat our panels at every M (15.2 against
  9.8 GFLOP/s at one token, 1,271 against 120 at 512). Quantized weights with 8-bit activations take
  AMX's int8 tiles from 16 rows on, VNNI below (`int8-amx`: the same integer sums, so the same bits).
* attention: the C++ paged kernel built for the ISA level, else gather + SDPA.

No torch at import: `/v1/models` and the wire carry a `CpuPath`. `prepare` (models/cpu_linear.py)
applies a path to a model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPES = ("auto", "float32", "bfloat16")
# weight-only quantization (models/quantize.py): auto keeps a GGUF's types as stored, none
# dequantizes; int8 per output channel, int4 group-wise (groups of 32, or 128)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "int4_g128")
# activations of the quantized linears: exact (fp32 sums: the dequantized weights' result), int8
# (each row rounded to int8 per block of 32, integer dot products: models/csrc/q8_linear.cpp), or auto
ACTIVATIONS = ("auto", "exact", "int8")
# The code forms of the int8 kernel (models/quant_linear.py packed_bits): 4, 5, 6 and 8 bits, and TABLE_CODES,
# IQ4's 4-bit indices into its table (models/csrc/code_planes.h TABLE)
TABLE_CODES = -4
CODE_FORMS = frozenset({4, 5, 6, 8, TABLE_CODES})
# Where auto means int8: per level, the code forms measured faster than exact at every M and within the
# perplexity bounds (docs/benchmarks.md, "8-bit activations"). 4-bit codes gain 1.1-1.8x. With VNNI, 8-bit
# codes are even at M=1 and 1.2-1.6x from M=8 on against the batch-invariant exact kernel (whose bf16 rows are
# fp32 sums: docs/benchmarks.md, "Batch invariance"); without VNNI they are 0.8x at M=1 (AVX2), so they stay
# exact there. The files' own 5- and 6-bit and table codes (Q5_K, Q6_K, IQ4_XS), which the exact kernel holds as
# 8-bit codes, were 1.2-2.0x exact under the AVX2 cap at M = 1..512 (docs/benchmarks.md "GGUF at real sizes").
# The portable build has no integer dot product: exact.
INT8_BY_DEFAULT = {"amx": CODE_FORMS, "avx512_bf16": CODE_FORMS, "avx512": CODE_FORMS - {8},
                   "avx2": CODE_FORMS - {8}}
# What runs the integer dot products at each level (`CpuPath.activations`)
INT8_KERNELS = {"amx": "int8-amx", "avx512_bf16": "int8-vnni", "avx512": "int8-avx512", "avx2": "int8-avx2", "generic": "int8-portable"}
# Where auto takes a prompt token's rows of the int8-activation linears off the int8 kernel, and onto what
# (`CpuPath.prompt_activations`): at the amx level, the codes dequantized to bf16 per call on AMX's bf16 tiles
# (models/csrc/q8_linear.cpp), 1.5-2x the int8 tiles from ~300 rows, but 5x slower at one row (the dequantizing is
# per call): prompts' calls are large, decode's small. Measured on an AMX Xeon (docs/benchmarks.md, "Prompts on
# bf16 tiles"). A token takes one kernel or the other by what it is, never by its call: batch invariant.
PROMPT_KERNELS = {"amx": "bf16-amx"}


@dataclass(frozen=True)
class CpuCapabilities:
    isa: str  # cpu_features.ISA_LEVELS
    onednn_dtypes: frozenset[str]  # dtypes oneDNN packs linear weights of, here
    panel_kernel: bool  # our panel-linear library built and loaded
    attention: str = "sdpa"  # probe.attention_backend(): native-<isa> (our kernel) or sdpa

    @property
    def bf16_native(self) -> bool:
        """bf16 matmuls run in hardware (AVX512-BF16), not emulated."""
        return self.isa in ("avx512_bf16", "amx") and "bfloat16" in self.onednn_dtypes


@dataclass(frozen=True)
class CpuPath:
    device: str
    isa: str
    dtype: str  # compute: activations, norms, attention, the KV cache's default
    weight_dtype: str  # the linears' weights as stored
    linear: str  # models.cpu_linear.LINEAR_PATHS, or "torch" off the CPU
    attention: str  # native-<isa> | sdpa | cuda
    num_threads: int
    note: str = ""  # why a slower choice was honoured
    quantization: str = "none"  # the quantized linears' formats (models/quant_linear.py), beside `linear`
    activations: str = "exact"  # the quantized linears' activations: exact, or INT8_KERNELS' name
    prompt_activations: str = ""  # PROMPT_KERNELS' name where prompt tokens take another kernel than `activations`

    def describe(self) -> str:
        quant = "" if self.quantization == "none" else f" quantized={self.quantization} activations={self.activations}"
        quant += f" prompts={self.prompt_activations}" if self.prompt_activations else ""
        text = (f"device={self.device} isa={self.isa} dtype={self.dtype} weights={self.weight_dtype} "
                f"linear={self.linear}{quant} attention={self.attention} threads={self.num_threads}")
        return f"{text} ({self.note})" if self.note else text

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_dtype(caps: CpuCapabilities, requested: str, checkpoint_dtype: str, device: str = "cpu") -> str:
    """`auto` -> the checkpoint's dtype where it computes natively here, else float32."""
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
    if requested != "auto":
        return requested
    if checkpoint_dtype == "float32":
        return "float32"
    return "bfloat16" if device != "cpu" or caps.bf16_native else "float32"


def int8_code_bits(caps: CpuCapabilities, requested: str) -> frozenset[int]:
    """The int8 kernel's code forms (CODE_FORMS) whose linears take int8 activations: all (int8), none (exact),
    or for auto those measured better at this level (INT8_BY_DEFAULT)."""
    if requested not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}")
    if requested == "auto":
        return INT8_BY_DEFAULT.get(caps.isa, frozenset())
    return CODE_FORMS if requested == "int8" else frozenset()


def prompt_kernel(caps: CpuCapabilities, requested: str) -> str:
    """What takes prompt tokens' int8-activation linears instead: PROMPT_KERNELS' entry for auto, nothing
    for an explicit int8 (every row on the integer kernel, as asked) or exact."""
    if requested not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}")
    return PROMPT_KERNELS.get(caps.isa, "") if requested == "auto" else ""


def choose_cpu_path(caps: CpuCapabilities, requested: str, checkpoint_dtype: str, weights_fit_bf16: bool,
                    num_threads: int, device: str = "cpu") -> CpuPath:
    """What to run. `weights_fit_bf16`: every linear weight is exactly a bf16 value (a bf16 checkpoint)."""
    dtype = resolve_dtype(caps, requested, checkpoint_dtype, device)
    if device != "cpu":
        return CpuPath(device, caps.isa, dtype, dtype, "torch", "cuda", num_threads)
    note = ""
    if dtype == "bfloat16" and caps.isa == "amx" and "bfloat16" in caps.onednn_dtypes:
        linear = "amx-bf16"
    elif dtype == "bfloat16" and caps.bf16_native:
        linear = "panels" if caps.panel_kernel else "onednn"
    elif dtype == "bfloat16":
        note = f"bfloat16 asked for on a CPU without bf16 arithmetic ({caps.isa}): slower than float32 here"
        linear = "panels" if caps.panel_kernel else "torch"
    # NOTE: panel weights are bf16: exact only where they were bf16 values to begin with
    elif weights_fit_bf16 and caps.panel_kernel:
        linear = "panels"
    else:
        linear = "onednn" if "float32" in caps.onednn_dtypes else "torch"
    weight_dtype = "bfloat16" if linear == "panels" else dtype
    return CpuPath(device, caps.isa, dtype, weight_dtype, linear, caps.attention, num_threads, note)
