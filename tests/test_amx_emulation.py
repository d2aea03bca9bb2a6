"""The emulated AMX tiles (models/csrc/amx_tiles.h, ATTNSERVE_AMX_EMULATED): what lets the amx build's kernels
run, and `make test-isa` test them, on an AVX512-BF16 CPU without AMX. Each emulated instruction against the
SDM's pseudo-code written out here in numpy, on shapes below the tiles' 16 x 64 bytes; the faults where the
hardware's would be; and when the level is emulated at all."""
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from models.native import cpu_features, toolchain
from models.native.cpu_features import amx_emulated
from tests.test_cpu_path import features

ROOT = Path(__file__).resolve().parents[1]
X86 = os.uname().machine == "x86_64"

# dst (M x N dwords) += A (M x K dwords) . B (K x N dwords); buffers at the tiles' largest, rows 64 bytes apart
PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "amx_tiles.h"

int main(int argc, char** argv) {
  const char* op = argv[1];
  const int m = atoi(argv[2]), k = atoi(argv[3]), n = atoi(argv[4]);
  TileConfig c;
  c.rows[0] = m, c.colsb[0] = 4 * n;
  c.rows[1] = m, c.colsb[1] = 4 * k;
  c.rows[2] = k, c.colsb[2] = 4 * n;
  if (strcmp(op, "unconfigured") == 0) c.rows[0] = 0, c.colsb[0] = 0;  // tile 0 left unused
  if (strcmp(op, "before_config") != 0) load_tile_config(c);
  alignas(64) unsigned char a[1024], b[1024], d[1024];
  if (fread(a, 1, 1024, stdin) != 1024 || fread(b, 1, 1024, stdin) != 1024 || fread(d, 1, 1024, stdin) != 1024) return 9;
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_loadd(0, d, 64);
  if (strcmp(op, "bf16") == 0) _tile_dpbf16ps(0, 1, 2);
  else if (strcmp(op, "sud") == 0) _tile_dpbsud(0, 1, 2);
  else if (strcmp(op, "same_tile") == 0) _tile_dpbssd(0, 1, 1);
  else _tile_dpbssd(0, 1, 2);
  std::memset(d, 0xff, sizeof d);
  _tile_stored(0, d, 64);
  _tile_release();
  fwrite(d, 1, 1024, stdout);
  return 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("amx") / "tiles"
    source = out.with_suffix(".cpp")
    source.write_text(PROGRAM)
    subprocess.run([os.environ.get("CXX", "g++"), "-O1", "-std=c++20", "-DATTNSERVE_AMX_EMULATED",
                    f"-I{ROOT / 'models' / 'csrc'}", str(source), "-o", str(out)], check=True, timeout=120)
    return out


def run(program: Path, op: str, shape: tuple[int, int, int], a: bytes, b: bytes, d: bytes):
    return subprocess.run([str(program), op, *map(str, shape)], input=a + b + d, capture_output=True, timeout=60)


def tile(rows: int, cols: int, dtype, values: np.ndarray) -> np.ndarray:
    """A 16 x 64-byte buffer holding `values` (rows x cols of dtype) in its corner, the rest filler."""
    buf = np.full(1024, 0x5A, np.uint8)
    view = buf.view(dtype).reshape(16, -1)
    view[:rows, :cols] = values
    return buf


def corner(out: bytes, rows: int, cols: int, dtype) -> np.ndarray:
    return np.frombuffer(out, dtype).reshape(16, -1)[:rows, :cols]


SHAPES = [(16, 16, 16), (5, 10, 7), (1, 3, 16), (16, 1, 1)]


@pytest.mark.skipif(not X86, reason="the emulation stands in for an x86 instruction set")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["ssd", "sud"])
def test_byte_dot_products_are_the_sdms_exact_int32_sums(program, op, shape):
    m, k, n = shape
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a = rng.integers(-128, 128, (m, k, 4), dtype=np.int8)
    b = rng.integers(0, 256, (k, n, 4)).astype(np.uint8 if op == "sud" else np.int8)
    d = rng.integers(-2**31, 2**31, (m, n), dtype=np.int64)
    d[0, 0] = 2**31 - 1  # the sum wraps past int32, as the instruction's does
    proc = run(program, op, shape, tile(m, 4 * k, np.int8, a.reshape(m, -1)).tobytes(),
               tile(k, 4 * n, b.dtype, b.reshape(k, -1)).tobytes(), tile(m, n, np.int32, d.astype(np.int32)).tobytes())
    assert proc.returncode == 0, proc.stderr
    expected = (d + np.einsum("mki,kni->mn", a.astype(np.int64), b.astype(np.int64)))
    expected = ((expected + 2**31) % 2**32 - 2**31).astype(np.int32)
    np.testing.assert_array_equal(corner(proc.stdout, m, n, np.int32), expected)
    assert (np.frombuffer(proc.stdout, np.int32).reshape(16, 16)[m:] == -1).all()  # nothing stored past its rows


def ftz(x: np.ndarray) -> np.ndarray:
    """Denormal fp32 to a zero of its sign (the instruction's DAZ on inputs and FTZ on results)."""
    bits = x.astype(np.float32).view(np.uint32)
    return np.where(bits & 0x7F800000 == 0, bits & 0x80000000, bits).astype(np.uint32).view(np.float32)


@pytest.mark.skipif(not X86, reason="the emulation stands in for an x86 instruction set")
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_dot_products_add_each_pairs_even_then_odd_product_in_fp32(program, shape):
    """TDPBF16PS per element: for each pair k in order, += a[2k] * b[2k], then += a[2k+1] * b[2k+1], each add
    rounded to fp32 (products are exact), denormals as zeros. Summed in another order, the bits differ."""
    m, k, n = shape
    rng = np.random.default_rng(k)
    bf16 = lambda x: (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731 - truncation: any bf16 will do
    a, b = bf16(rng.standard_normal((m, k, 2)) * 3), bf16(rng.standard_normal((k, n, 2)))
    d = (rng.standard_normal((m, n)) * 1e3).astype(np.float32)
    a[0], a[0, 0, 0], b[0, 0, 0], d[0, 0] = 0, 0x0001, 0x5D80, 0  # a denormal (read as zero) times 2^60 into zero
    proc = run(program, "bf16", shape, tile(m, 2 * k, np.uint16, a.reshape(m, -1)).tobytes(),
               tile(k, 2 * n, np.uint16, b.reshape(k, -1)).tobytes(), tile(m, n, np.float32, d).tobytes())
    assert proc.returncode == 0, proc.stderr
    wide = lambda x: ftz((x.astype(np.uint32) << 16).view(np.float32))  # noqa: E731
    af, bf = wide(a), wide(b)
    expected = d.copy()
    for kk in range(k):
        for i in (0, 1):
            expected = ftz(expected + af[:, kk, i][:, None] * bf[kk, :, i][None, :])
    np.testing.assert_array_equal(corner(proc.stdout, m, n, np.float32), expected)


@pytest.mark.skipif(not X86, reason="the emulation stands in for an x86 instruction set")
@pytest.mark.parametrize("op,shape,fault", [
    ("before_config", (16, 16, 16), "before ldtilecfg"),
    ("unconfigured", (16, 16, 16), "configuration leaves unused"),
    ("same_tile", (16, 16, 16), "tile named twice"),
    ("ssd", (16, 17, 16), "over 16 rows or 64 bytes"),  # B's 17 rows
])
def test_what_faults_on_the_hardware_aborts_here(program, op, shape, fault):
    proc = run(program, op, shape, bytes(1024), bytes(1024), bytes(1024))
    assert proc.returncode < 0 and "emulated AMX fault: " in proc.stderr.decode()
    assert fault in proc.stderr.decode()


def test_the_emulated_level_is_amx_only_on_an_avx512_bf16_cpu_without_it(monkeypatch):
    zen4, spr = features("zen4"), features("sapphire_rapids")
    on = {cpu_features.EMULATION_ENV: "1"}
    assert amx_emulated(zen4, on) and not amx_emulated(zen4, {})
    assert not amx_emulated(features("skylake_x"), on) and not amx_emulated(features("epyc_avx2"), on)
    assert not amx_emulated(spr, on)  # real tiles (or a refusal of them) are never emulated
    # the level follows, the caps still lower it, and the tile libraries build their emulated tiles
    monkeypatch.setattr(cpu_features, "read_cpu_features", lambda: zen4)
    monkeypatch.setattr(toolchain, "read_cpu_features", lambda: zen4)
    assert cpu_features.machine_isa(on) == "amx"
    assert cpu_features.machine_isa({**on, "ATTNSERVE_CPU_ISA": "avx512_bf16"}) == "avx512_bf16"
    assert cpu_features.machine_isa({}) == "avx512_bf16"
    monkeypatch.setenv(cpu_features.EMULATION_ENV, "1")
    assert "-DATTNSERVE_AMX_EMULATED" in toolchain.flags("q8_linear", "amx")
    assert "-mamx-tile" not in toolchain.flags("q8_linear", "amx")
    assert "-DATTNSERVE_AMX_EMULATED" not in toolchain.flags("q8_linear", "avx512_bf16")
    assert "-DATTNSERVE_AMX_EMULATED" not in toolchain.flags("decoder", "amx")  # no tile code: its avx512_bf16 build
    monkeypatch.delenv(cpu_features.EMULATION_ENV)
    assert "-mamx-tile" in toolchain.flags("q8_linear", "amx")
