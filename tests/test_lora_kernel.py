"""The grouped LoRA delta in C++ (models/csrc/lora.cpp) against torch's reference: random segments of
unsorted rows, ranks 0 to R per slot and piece, fp32 and bf16 activations and slots; base rows keep
every bit; and the op inside torch.compile."""
from __future__ import annotations

import pytest
import torch

from models.lora import LoraMetadata, LoraSlots, LoraStep, lora_add_reference
from models.lora_format import LoraShapes
from models.native.libraries import available
from server.engine.compilation import compile_model, compiled_graphs

R = 16
SLOTS = 4
SPLITS = [72, 20, 20]  # widths with a vector tail at every level (and one below a vector at AVX-512)
IN = 83  # a dot product's scalar tail too


def case(seed: int, dtype: torch.dtype, wdtype: torch.dtype, total: int = 150):
    """y, x, a, bt, ranks and segments: one of 100 rows (a prefill chunk: at::mm from 96), one of 13 (several
    register tiles), one row, an empty one; each segment's rows come in random order."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(total, sum(SPLITS), generator=g).to(dtype)
    x = torch.randn(total, IN, generator=g).to(dtype)
    a = (torch.randn(SLOTS, len(SPLITS) * R, IN, generator=g) / IN ** 0.5).to(wdtype)
    bt = torch.randn(SLOTS, R, sum(SPLITS), generator=g).to(wdtype)
    ranks = torch.randint(0, R + 1, (SLOTS, len(SPLITS)), generator=g)
    ranks[0] = torch.tensor([R, 0, 1])  # the extremes
    ranks[3] = torch.tensor([1, R, 0])
    rows = torch.randperm(total, generator=g)[:100 + 13 + 1 + 5]
    seg_start = torch.tensor([0, 100, 113, 114, 114, 119])
    seg_slot = torch.tensor([3, 1, 0, 2, 2])
    return y, x, a, bt, ranks, rows, seg_start, seg_slot


@pytest.mark.kernel  # make test-isa runs it again under the AVX2 cap and on the portable build
@pytest.mark.parametrize("dtype, wdtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "fp32-bf16-slots", "bf16-fp32-slots", "bf16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_equals_reference(dtype, wdtype, seed):
    assert available("lora")
    y, x, a, bt, ranks, rows, seg_start, seg_slot = case(seed, dtype, wdtype)
    want = y.clone()
    lora_add_reference(want, x, a, bt, ranks, rows, seg_start, seg_slot, SPLITS)
    got = y.clone()
    torch.ops.attnserve.lora_add_(got, x, a, bt, ranks, rows, seg_start, seg_slot, SPLITS)
    base = torch.ones(len(y), dtype=torch.bool)
    base[rows] = False
    assert torch.equal(got[base], y[base])  # bit for bit: never read, never written
    assert not torch.equal(got[~base], y[~base])
    if dtype == wdtype == torch.bfloat16:  # the long segment multiplies in bf16, as PEFT's bf16 layers do
        long = rows[:seg_start[1]]
        want[long] = bf16_segment(y, x, a, bt, ranks, long, int(seg_slot[0]))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # each rounds an fp32 sum once; the sums' orders differ: at most one bf16 step apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)


def bf16_segment(y, x, a, bt, ranks, idx, slot):
    """A long segment's rows as bf16 GEMMs give them: x.A^T rounded to bf16, then .B^T, added in fp32."""
    out, col = y[idx].float(), 0
    for p, width in enumerate(SPLITS):
        r = int(ranks[slot, p])
        if r:
            h = x[idx] @ a[slot, p * R:p * R + r].T  # (n, r) bf16
            out[:, col:col + width] += (h @ bt[slot, :r, col:col + width]).float()
        col += width
    return out.to(y.dtype)


@pytest.mark.kernel
def test_no_rows_and_bad_rows():
    y, x, a, bt, ranks, rows, seg_start, seg_slot = case(0, torch.float32, torch.float32)
    got = y.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    torch.ops.attnserve.lora_add_(got, x, a, bt, ranks, empty, torch.zeros(1, dtype=torch.int64), empty, SPLITS)
    assert torch.equal(got, y)
    twice = rows.clone()
    twice[1] = twice[0]
    with pytest.raises(RuntimeError, match="distinct"):  # NOTE: two tasks would write one row
        torch.ops.attnserve.lora_add_(got, x, a, bt, ranks, twice, seg_start, seg_slot, SPLITS)
    with pytest.raises(RuntimeError, match="rank"):
        torch.ops.attnserve.lora_add_(got, x, a, bt, ranks + R, rows, seg_start, seg_slot, SPLITS)


def random_slots(dtype: torch.dtype) -> LoraSlots:
    shapes = LoraShapes("llama", 1, 96, 64, 32, 160, True, 3, 8)
    slots = LoraSlots(shapes, dtype)
    g = torch.Generator().manual_seed(3)
    for t in slots.a.values():
        t.copy_(torch.randn(t.shape, generator=g) / 10)
    for t in slots.bt.values():
        t.copy_(torch.randn(t.shape, generator=g))
    for t in slots.ranks.values():
        t.copy_(torch.randint(0, 9, t.shape, generator=g))
    return slots


def qkv_case():
    slots = random_slots(torch.float32)
    step = LoraStep(slots, LoraMetadata.of([1, None, 0, 2, 1, None]))
    x = torch.randn(6, 96)
    w = torch.randn(128, 96)  # qkv's out: 64 + 32 + 32

    def qkv(x):
        return step.apply(0, "qkv", x, x @ w.T) * 2

    return step, x, w, qkv


@pytest.mark.kernel
def test_step_takes_the_kernel():
    step, x, w, qkv = qkv_case()
    assert step.slots.native
    want = x @ w.T
    slots = step.slots
    lora_add_reference(want, x, slots.a[0, "qkv"], slots.bt[0, "qkv"], slots.ranks[0, "qkv"], step.meta.rows,
                       step.meta.seg_start, step.meta.seg_slot, [64, 32, 32])
    torch.testing.assert_close(qkv(x), want * 2, rtol=1e-5, atol=1e-5)


@pytest.mark.kernel
def test_op_compiled():
    """The op traces (its fake) without a graph break, and the compiled function gives eager's values."""
    _, x, _, qkv = qkv_case()

    class Qkv(torch.nn.Module):
        def forward(self, x):
            return qkv(x)

    eager = qkv(x)
    before = compiled_graphs()
    # NOTE: the engine's compile (inductor's cache and -march follow ATTNSERVE_CPU_ISA), as the step's
    compiled = compile_model(Qkv())(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert compiled_graphs() == before + 1  # one graph: no break at the op
