"""The panel linear (bf16 weights; fp32 math for fp32 activations, bf16 pairs on AVX512-BF16 builds
for bf16 ones) against float64, for the ISA level this process runs at (CI runs this file under
ATTNSERVE_CPU_ISA=avx2 and generic too), and swapped into a model."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.cpu_linear import PanelLinear, fits_bf16, pack_linears
from models.native.libraries import load

pytestmark = pytest.mark.kernel  # make test-isa runs this file again under the AVX2 cap and on the portable build


def bf16_valued(*shape, generator=None):
    return torch.randn(*shape, generator=generator).bfloat16().float()


# Shapes around the register tiles: features not a multiple of a panel (2W), odd K, every row
# count up to two full tiles, and the model's own (576 -> 1536, 1536 -> 576, the LM head).
SHAPES = [(1, 7, 3), (5, 37, 19), (13, 100, 64), (7, 33, 576), (1, 1536, 576), (4, 576, 1536), (31, 45, 20),
          (64, 130, 72), (100, 48, 16), (3, 49152, 64)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_float64_for_fp32_inputs(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, b, x = bf16_valued(n, k, generator=g), torch.randn(n, generator=g), torch.randn(m, k, generator=g)
    load("panel_linear")
    y = torch.ops.attnserve.panel_linear(x, torch.ops.attnserve.pack_panels(w), b, n)
    expected = F.linear(x.double(), w.double(), b.double())
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y.double() - expected).abs().max() <= 1e-5 * max(1.0, k ** 0.5)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_matches_float64_for_bf16_inputs(m, n, k):
    """bf16 x: pairs of bf16 products summed in fp32 (or widened, odd K or no AVX512-BF16), one
    bf16 rounding of the output."""
    g = torch.Generator().manual_seed(m * 1000 + n + k + 1)
    w, b, x = bf16_valued(n, k, generator=g), torch.randn(n, generator=g), torch.randn(m, k, generator=g).bfloat16()
    y = torch.ops.attnserve.panel_linear(x, torch.ops.attnserve.pack_panels(w), b.bfloat16(), n)
    expected = F.linear(x.double(), w.double(), b.bfloat16().double())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    tolerance = 2 ** -8 * expected.abs() + 1e-5 * max(1.0, k ** 0.5)
    assert ((y.double() - expected).abs() <= tolerance).all()


def test_every_row_count_and_bias_free():
    """Rows 1..40 in one call: tiles of every height, one and two panels at a time."""
    g = torch.Generator().manual_seed(1)
    w = bf16_valued(70, 48, generator=g)
    packed = torch.ops.attnserve.pack_panels(w)
    for m in range(1, 41):
        x = torch.randn(m, 48, generator=g)
        y = torch.ops.attnserve.panel_linear(x, packed, None, 70)
        assert (y.double() - x.double() @ w.double().T).abs().max() < 1e-4, m


def test_bf16_inputs_3d_shapes_and_empty_batches():
    g = torch.Generator().manual_seed(2)
    w, b = bf16_valued(40, 24, generator=g), torch.randn(40, generator=g).bfloat16()
    packed = torch.ops.attnserve.pack_panels(w)
    x = torch.randn(2, 5, 24, generator=g).bfloat16()
    y = torch.ops.attnserve.panel_linear(x, packed, b, 40)
    expected = F.linear(x.double(), w.double(), b.double())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 40)
    assert (y.double() - expected).abs().max() <= 2 ** -7 * expected.abs().max()  # one bf16 rounding of the output
    assert torch.ops.attnserve.panel_linear(torch.zeros(0, 24), packed, None, 40).shape == (0, 40)


def test_refuses_weights_of_another_layout():
    packed = torch.ops.attnserve.pack_panels(bf16_valued(40, 24))
    with pytest.raises(RuntimeError, match="packed by this library"):  # e.g. panels of another ISA's width
        torch.ops.attnserve.panel_linear(torch.randn(2, 24), packed.reshape(-1, 24, packed.shape[2] // 2), None, 40)
    with pytest.raises(RuntimeError, match="x has 22 features"):
        torch.ops.attnserve.panel_linear(torch.randn(2, 22), packed, None, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.attnserve.panel_linear(torch.randn(2, 24), packed, None, 400)


def test_swapped_into_a_model_and_compiled():
    """pack_linears swaps every nn.Linear (the bias kept in fp32); eager and compiled calls agree."""
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 16, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(bf16_valued(*p.shape, generator=g))
    x = torch.randn(9, 32, generator=g)
    with torch.no_grad():
        expected = model.double()(x.double())
    model.float()
    assert fits_bf16(m.weight for m in model if isinstance(m, nn.Linear))
    assert pack_linears(model, "panels") == 2 and all(isinstance(model[i], PanelLinear) for i in (0, 2))
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, dynamic=True)(x)
    assert (eager.double() - expected).abs().max() <= 1e-6 * expected.abs().max()  # fp32 sums
    assert torch.equal(eager, compiled)


def test_fits_bf16_and_unknown_paths():
    assert fits_bf16([torch.tensor([1.5, -2.0, 0.0078125])]) and not fits_bf16([torch.tensor([1.0 + 2 ** -10])])
    with pytest.raises(ValueError, match="unknown linear path"):
        pack_linears(nn.Linear(2, 2), "mkl")
    plain = nn.Sequential(nn.Linear(2, 2))
    assert pack_linears(plain, "torch") == 0 and type(plain[0]) is nn.Linear
