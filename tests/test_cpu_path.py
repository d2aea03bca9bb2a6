"""The CPU path: ISA levels from /proc/cpuinfo, caps, the choice as a pure function of what the
machine can do, artifacts named by CPU features, and capped runs that really take the capped path.

The tests marked `caps` need every library built at AVX2 and at the portable level (~2 min of
compiling on 2 cores), or check the portable level's ARM build: `make test-isa` runs them, after
building those levels; `make test` does not."""
import json
import os
import shutil
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest

from models.native import cpu_features
from models.native.cpu_features import (
    ISA_LEVELS,
    CpuFeatures,
    capped_march,
    choose_isa,
    isa_cap,
    parse_cpuinfo,
    torch_isa_env,
)
from models.native.cpu_path import (
    DTYPES,
    INT8_KERNELS,
    TABLE_CODES,
    CpuCapabilities,
    CpuPath,
    choose_cpu_path,
    int8_code_bits,
    prompt_kernel,
    resolve_dtype,
)

ROOT = Path(__file__).resolve().parents[1]

BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
        "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl pni pclmulqdq ssse3 cx16 sse4_1 "
        "sse4_2 x2apic popcnt aes xsave rdrand hypervisor lahf_lm")
V3 = "fma movbe avx f16c abm bmi1 avx2 bmi2"
V4 = "avx512f avx512dq avx512cd avx512bw avx512vl"


def cpuinfo(model: str, flags: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
            f"processor\t: 1\nmodel name\t: {model}\nflags\t\t: {flags}\n")


CPUS = {  # /proc/cpuinfo of each kind of CPU, and its level
    "zen4": (cpuinfo("AMD EPYC 9R14", f"{BASE} {V3} {V4} avx512_bf16 avx512_vnni avx512ifma"), "avx512_bf16"),
    "epyc_avx2": (cpuinfo("AMD EPYC 7R13", f"{BASE} {V3} sha_ni clzero"), "avx2"),
    "skylake_x": (cpuinfo("Intel(R) Xeon(R) Platinum 8175M", f"{BASE} {V3} {V4} avx512_vnni"), "avx512"),
    # lists AMX: the level once the kernel grants the tiles (choose_isa's `tiles`)
    "sapphire_rapids": (cpuinfo("Intel(R) Xeon(R) Platinum 8488C", f"{BASE} {V3} {V4} avx512_bf16 avx512_vnni avx_vnni "
                                "amx_bf16 amx_tile amx_int8"), "amx"),
    "avx_only": (cpuinfo("Intel(R) Xeon(R) CPU E5-2670", f"{BASE} avx"), "generic"),
    "avx2_no_fma": (cpuinfo("odd", f"{BASE} avx avx2 f16c bmi1 bmi2 movbe abm"), "generic"),
}
GRAVITON3 = ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
             "fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat "
             "ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\nCPU part\t: 0xd40\n")


def features(kind: str) -> CpuFeatures:
    return parse_cpuinfo(CPUS[kind][0], "x86_64")


@pytest.mark.parametrize("kind", sorted(CPUS))
def test_isa_level_from_cpuinfo(kind):
    f = features(kind)
    assert f.isa == CPUS[kind][1] and f.arch == "x86_64" and "sse2" in f.flags
    assert f.model.startswith(("AMD", "Intel", "odd"))


def test_arm_and_unknown_cpus_are_generic():
    arm = parse_cpuinfo(GRAVITON3, "aarch64")
    assert arm.isa == "generic" and "bf16" in arm.flags and arm.model == "0xd40"
    assert torch_isa_env("generic", arm) == {} and capped_march("generic", arm) is None
    assert CpuFeatures("x86_64", "?", frozenset()).isa == "generic"


def test_caps_lower_the_level_and_never_raise_it():
    zen4, avx2 = features("zen4"), features("epyc_avx2")
    assert choose_isa(zen4, {}) == "avx512_bf16" and choose_isa(avx2, {}) == "avx2"
    for cap in ISA_LEVELS:
        assert choose_isa(zen4, {"ATTNSERVE_CPU_ISA": cap}) == min(cap, "avx512_bf16", key=ISA_LEVELS.index)
        assert choose_isa(avx2, {"ATTNSERVE_CPU_ISA": cap}) == min(cap, "avx2", key=ISA_LEVELS.index)
    # torch's and oneDNN's own caps count too (the way machine.md tests the lower path)
    assert choose_isa(zen4, {"ATEN_CPU_CAPABILITY": "avx2"}) == "avx2"
    assert choose_isa(zen4, {"ATEN_CPU_CAPABILITY": "default"}) == "generic"
    assert choose_isa(zen4, {"ATEN_CPU_CAPABILITY": "avx512"}) == "avx512_bf16"
    assert choose_isa(zen4, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "avx2"
    assert choose_isa(zen4, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}) == "avx512"
    assert choose_isa(zen4, {"ONEDNN_MAX_CPU_ISA": "ALL"}) == "avx512_bf16"
    assert isa_cap({"ATTNSERVE_CPU_ISA": " AVX2 "}) == "avx2" and isa_cap({}) == "auto"
    with pytest.raises(ValueError, match="ATTNSERVE_CPU_ISA='sse9'"):
        isa_cap({"ATTNSERVE_CPU_ISA": "sse9"})


def test_torch_and_onednn_follow_the_level():
    zen4 = features("zen4")
    assert torch_isa_env("avx2", zen4) == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert torch_isa_env("generic", zen4) == {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    assert torch_isa_env("avx512_bf16", zen4)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    spr = features("sapphire_rapids")
    for level in ISA_LEVELS:  # every level's env reads back as that level
        assert choose_isa(spr, torch_isa_env(level, spr), tiles=True) == level
        if level != "amx":
            assert choose_isa(zen4, torch_isa_env(level, zen4)) == level
    assert capped_march("avx512_bf16", zen4) is None  # the CPU's own level: inductor's -march=native
    assert capped_march("avx2", zen4) == "x86-64-v3" and capped_march("generic", zen4) == "x86-64"


def test_amx_counts_only_once_the_tiles_are_granted():
    """A CPU listing AMX is at the amx level only where the kernel granted its tiles; any cap below
    turns AMX off (torch's and oneDNN's too), and oneDNN's own AMX cap reads back as the level."""
    spr = features("sapphire_rapids")
    assert spr.isa == "amx"
    assert choose_isa(spr, {}, tiles=True) == "amx" and choose_isa(spr, {}, tiles=False) == "avx512_bf16"
    assert choose_isa(spr, {"ATTNSERVE_CPU_ISA": "avx512_bf16"}, tiles=True) == "avx512_bf16"
    assert choose_isa(spr, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, tiles=True) == "amx"
    assert choose_isa(spr, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, tiles=True) == "avx512_bf16"
    assert torch_isa_env("amx", spr) == {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}
    assert cpu_features.amx_listed(spr, {}) and cpu_features.amx_listed(spr, {"ATTNSERVE_CPU_ISA": "amx"})
    assert not cpu_features.amx_listed(spr, {"ATTNSERVE_CPU_ISA": "avx512_bf16"})  # capped: never asked
    assert not cpu_features.amx_listed(features("zen4"), {})


def fake_arch_prctl(supported: int, request: int, permitted: int):
    """arch_prctl as a kernel would answer it: the XCR0 mask, the request's errno (0: granted), the mask
    granted after."""
    from models.native import tiles

    def call(code, arg):
        if code == tiles.ARCH_GET_XCOMP_SUPP:
            arg.value = supported
        elif code == tiles.ARCH_REQ_XCOMP_PERM:
            return (0, 0) if request == 0 else (-1, request)
        elif code == tiles.ARCH_GET_XCOMP_PERM:
            arg.value = permitted
        return 0, 0
    return call


TILE_STATE = 1 << 17 | 1 << 18  # XTILECFG, XTILEDATA


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="arch_prctl is x86-64 Linux's")
def test_tile_requests_as_each_kernel_answers(monkeypatch, tmp_path):
    """Granted (and a tile operation ran in a child), refused by XCR0, refused by the request, and a
    permission granted whose first tile operation faults: only the first is AMX."""
    import errno

    from models.native import tiles

    monkeypatch.setattr(tiles, "_arch_prctl", fake_arch_prctl(TILE_STATE, 0, TILE_STATE))
    assert tiles.request_tiles().granted
    monkeypatch.setattr(tiles, "_arch_prctl", fake_arch_prctl(1 << 17, 0, 0))
    assert "XCR0" in str(tiles.request_tiles()) and not tiles.request_tiles().granted
    monkeypatch.setattr(tiles, "_arch_prctl", fake_arch_prctl(TILE_STATE, errno.EPERM, 0))
    refused = tiles.request_tiles()
    assert not refused.granted and "refused the tile permission" in str(refused)
    monkeypatch.setattr(tiles, "_arch_prctl", fake_arch_prctl(TILE_STATE, 0, 0))
    assert "not granted" in str(tiles.request_tiles())
    faulting = tmp_path / "probe"  # a child that dies on its first tile instruction, as such a VM's do
    faulting.write_text("#!/bin/sh\nkill -ILL $$\n")
    faulting.chmod(0o755)
    monkeypatch.setattr(tiles, "_probe_binary", lambda: faulting)
    probe = tiles.run_tile_probe()
    assert not probe.granted and "faulted in a child process (signal 4)" in str(probe)
    monkeypatch.undo()  # this machine's own kernel: never tiles for a CPU without them
    if not tiles.AMX_FLAGS <= cpu_features.read_cpu_features().flags:
        assert not tiles.request_tiles().granted


REFUSED_RUN = """
import dataclasses, errno, json, logging, sys
import models.native.cpu_features as cf
import models.native.tiles as tiles
real = cf.read_cpu_features()
cf.read_cpu_features = lambda: dataclasses.replace(real, flags=real.flags | tiles.AMX_FLAGS)
def deny(code, arg):  # a kernel that supports the tile state but refuses this process
    if code == tiles.ARCH_GET_XCOMP_SUPP:
        arg.value = 1 << 17 | 1 << 18
        return 0, 0
    return (-1, errno.EPERM) if code == tiles.ARCH_REQ_XCOMP_PERM else (0, 0)
tiles._arch_prctl = deny
logging.basicConfig(level=logging.WARNING)
isa = cf.apply_isa_cap()
import os
from server.engine import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1], kv_cache_memory=None, num_blocks=64))
out = engine.generate([engine.tokenizer.encode("The capital of France is")],
                      SamplingParams(max_tokens=8, temperature=0))[0][0]
print(json.dumps({"isa": isa, "path": engine.cpu_path.describe(), "text": out.text,
                  "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA", "")}))
"""


# NOTE: slow on an AMX CPU, where it compiles the level below's builds of both tile libraries (q8_linear
# ~11 s, paged_attention ~30 s), which no other test there loads
@pytest.mark.slow
def test_amx_listed_but_refused_serves_on_the_level_below(default_model_dir):
    """End to end: a CPU that lists AMX (faked on top of this one's flags) whose kernel refuses the
    tiles: one warning saying so, the level below (oneDNN capped off its tiles where it would have
    found them), and the default model answers."""
    from models.native import tiles

    listed = cpu_features.read_cpu_features()
    listed = CpuFeatures(listed.arch, listed.model, listed.flags | tiles.AMX_FLAGS)
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNSERVE_CPU_ISA", "ONEDNN_MAX_CPU_ISA",
                                                            "ATEN_CPU_CAPABILITY")}
    proc = subprocess.run([sys.executable, "-c", REFUSED_RUN, str(default_model_dir)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert "lists AMX but the kernel refused the tile permission (Operation not permitted)" in proc.stderr
    assert result["isa"] == choose_isa(listed, {}, tiles=False) != "amx"
    assert f"isa={result['isa']}" in result["path"]
    assert result["onednn"] == ("AVX512_CORE_BF16" if listed.isa == "amx" else "")
    assert result["text"].strip()


ZEN4 = CpuCapabilities("avx512_bf16", frozenset({"float32", "bfloat16"}), True, "native-avx512_bf16")
AMX = CpuCapabilities("amx", frozenset({"float32", "bfloat16"}), True, "native-amx")  # tiles granted
ZEN4_NO_COMPILER = CpuCapabilities("avx512_bf16", frozenset({"float32", "bfloat16"}), False, "sdpa")
AVX2 = CpuCapabilities("avx2", frozenset({"float32"}), True, "native-avx2")
AVX512 = CpuCapabilities("avx512", frozenset({"float32", "bfloat16"}), True, "native-avx512")  # oneDNN emulates bf16
AVX2_NO_COMPILER = CpuCapabilities("avx2", frozenset({"float32"}), False, "sdpa")
GENERIC = CpuCapabilities("generic", frozenset({"float32"}), True, "native-generic")

# (capabilities, requested, checkpoint dtype, weights are bf16 values) -> (dtype, weights, linear, note?)
CHOICES = [
    (ZEN4, "auto", "bfloat16", True, ("bfloat16", "bfloat16", "panels", False)),
    (AMX, "auto", "bfloat16", True, ("bfloat16", "bfloat16", "amx-bf16", False)),
    (AMX, "float32", "bfloat16", True, ("float32", "bfloat16", "panels", False)),
    (AMX, "auto", "float32", False, ("float32", "float32", "onednn", False)),
    (ZEN4_NO_COMPILER, "auto", "bfloat16", True, ("bfloat16", "bfloat16", "onednn", False)),
    (ZEN4, "float32", "bfloat16", True, ("float32", "bfloat16", "panels", False)),
    (ZEN4, "auto", "float32", False, ("float32", "float32", "onednn", False)),
    (ZEN4, "bfloat16", "float32", False, ("bfloat16", "bfloat16", "panels", False)),
    (AVX2, "auto", "bfloat16", True, ("float32", "bfloat16", "panels", False)),
    (AVX2, "bfloat16", "bfloat16", True, ("bfloat16", "bfloat16", "panels", True)),
    (AVX2, "auto", "float16", False, ("float32", "float32", "onednn", False)),
    (AVX2, "auto", "float32", False, ("float32", "float32", "onednn", False)),
    (AVX512, "auto", "bfloat16", True, ("float32", "bfloat16", "panels", False)),
    (AVX512, "bfloat16", "bfloat16", True, ("bfloat16", "bfloat16", "panels", True)),
    (AVX2_NO_COMPILER, "auto", "bfloat16", True, ("float32", "float32", "onednn", False)),
    (AVX2_NO_COMPILER, "bfloat16", "bfloat16", True, ("bfloat16", "bfloat16", "torch", True)),
    (GENERIC, "auto", "bfloat16", True, ("float32", "bfloat16", "panels", False)),
]


@pytest.mark.parametrize("caps,requested,source,fits,expected", CHOICES)
def test_path_choice(caps, requested, source, fits, expected):
    path = choose_cpu_path(caps, requested, source, fits, 2)
    assert (path.dtype, path.weight_dtype, path.linear, bool(path.note)) == expected
    assert path.isa == caps.isa and path.attention == caps.attention and path.num_threads == 2
    assert f"linear={path.linear}" in path.describe() and f"isa={caps.isa}" in path.describe()
    if path.note:
        assert "without bf16 arithmetic" in path.note and path.note in path.describe()


# (capabilities, --activations) -> the int8 kernel's code forms whose linears take int8 activations
ALL = {4, 5, 6, 8, TABLE_CODES}
ACTIVATION_CHOICES = [
    (ZEN4, "auto", ALL), (AMX, "auto", ALL), (AVX512, "auto", ALL - {8}), (AVX2, "auto", ALL - {8}),
    (GENERIC, "auto", set()), (ZEN4, "int8", ALL), (GENERIC, "int8", ALL), (ZEN4, "exact", set()), (AVX2, "exact", set()),
]


@pytest.mark.parametrize("caps,requested,expected", ACTIVATION_CHOICES)
def test_int8_activations_choice(caps, requested, expected):
    """auto: int8 where an integer dot product is measured faster: 4-, 5- and 6-bit and table codes, and 8-bit ones
    with VNNI (without it 0.8x at batch 1); exact on the portable build; an explicit switch holds everywhere."""
    assert int8_code_bits(caps, requested) == frozenset(expected)


@pytest.mark.parametrize("caps,requested,expected", [
    (AMX, "auto", "bf16-amx"), (AMX, "int8", ""), (AMX, "exact", ""), (ZEN4, "auto", ""), (AVX2, "auto", ""),
    (GENERIC, "auto", ""),
])
def test_prompt_kernel_choice(caps, requested, expected):
    """auto at the amx level: prompt tokens' int8-activation linears on bf16 tiles; an explicit int8 keeps every
    row on the integer kernel; no other level has a prompt kernel."""
    assert prompt_kernel(caps, requested) == expected
    with pytest.raises(ValueError, match="activations must be one of"):
        prompt_kernel(caps, "fp8")


def test_the_path_line_names_the_prompt_kernel_only_where_there_is_one():
    path = CpuPath("cpu", "amx", "bfloat16", "Q4_1", "quantized", "native-amx", 2, quantization="Q4_1",
                   activations="int8-amx")
    assert "activations=int8-amx attention=" in path.describe()
    assert "activations=int8-amx prompts=bf16-amx attention=" in CpuPath(
        **{**path.as_dict(), "prompt_activations": "bf16-amx"}).describe()


def test_int8_activations_reject_unknown_modes_and_name_each_levels_kernel():
    with pytest.raises(ValueError, match="activations must be one of auto, exact, int8"):
        int8_code_bits(ZEN4, "fp8")
    assert INT8_KERNELS == {"amx": "int8-amx", "avx512_bf16": "int8-vnni", "avx512": "int8-avx512",
                            "avx2": "int8-avx2", "generic": "int8-portable"}
    assert set(INT8_KERNELS) == set(ISA_LEVELS)


def test_no_choice_runs_what_the_machine_refuses():
    """Over every combination: oneDNN only for a dtype it packs, the panel kernel only where it
    built, bf16 weights only where they hold bf16 values or bf16 was asked for, and `auto` is
    bf16 only where bf16 arithmetic is native."""
    dtype_sets = [frozenset(), frozenset({"float32"}), frozenset({"float32", "bfloat16"})]
    for isa, onednn, panels, requested, source, fits in product(ISA_LEVELS, dtype_sets, (True, False), DTYPES,
                                                                 ("float32", "bfloat16"), (True, False)):
        caps = CpuCapabilities(isa, onednn, panels)
        path = choose_cpu_path(caps, requested, source, fits, 1)
        if path.linear in ("onednn", "amx-bf16"):
            assert path.dtype in onednn and path.weight_dtype == path.dtype
        if path.linear == "amx-bf16":
            assert isa == "amx" and path.dtype == "bfloat16"
        if path.linear == "panels":
            assert panels and path.weight_dtype == "bfloat16"
        if path.weight_dtype != path.dtype:
            assert path.weight_dtype == "bfloat16" and (fits or path.dtype == "bfloat16")
        if requested == "auto" and path.dtype == "bfloat16":
            assert caps.bf16_native and source == "bfloat16"
        assert path.dtype == resolve_dtype(caps, requested, source)
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype(ZEN4, "float16", "bfloat16")


def test_l3_size_from_sysfs(tmp_path):
    """bench_engine's roofline level: the L3 as Linux lists it (index3 here; levels 1 and 2 skipped)."""
    from models.native.memory import l3_bytes, parse_cache_size

    for index, (level, size) in enumerate([("1", "48K"), ("2", "2048K"), ("3", "491520K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(level + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert l3_bytes(tmp_path) == 480 * 2**20
    assert parse_cache_size("32M") == 32 * 2**20 and parse_cache_size("1G") == 2**30
    assert l3_bytes(tmp_path / "none") is None


def test_amx_bf16_linears_are_onednns_packed_matmuls():
    """The amx level's bf16 linears: oneDNN's packed matmul (on the tiles where the CPU has them; on
    this CPU its own kernels), the onednn path's module, its outputs those of F.linear in bf16."""
    import torch

    from models.cpu_linear import PackedLinear, pack_linears

    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)).bfloat16()
    x = torch.randn(5, 64, generator=g).bfloat16()
    with torch.no_grad():
        expected = model(x).float()
        assert pack_linears(model, "amx-bf16") == 2 and all(isinstance(m, PackedLinear) for m in model)
        got = model(x).float()
    assert got.dtype == torch.float32 and (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_off_the_cpu_auto_keeps_the_checkpoint_dtype():
    path = choose_cpu_path(CpuCapabilities("avx2", frozenset(), False, "cuda"), "auto", "bfloat16", True, 1, "cuda")
    assert (path.device, path.dtype, path.linear, path.attention) == ("cuda", "bfloat16", "torch", "cuda")


def _run(code: str, env: dict, args: list[str] = (), timeout: int = 600) -> subprocess.CompletedProcess:
    """Python in a fresh process; this one's own torch caps (set by a run under a cap) and inductor cache
    (set by a compile in this process) left out."""
    mine = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CACHE_DIR")
    env = {**{k: v for k, v in os.environ.items() if k not in mine}, **env}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_artifacts_are_named_by_level_and_cpu(monkeypatch, tmp_path):
    """Libraries carry their level in their name and are built for it, never -march=native;
    inductor's cache is named by level and CPU flags. A faked AVX2-only CPU gets other names."""
    from models.native import toolchain
    from server.engine import compilation

    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNSERVE_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    names = {}
    for kind in ("zen4", "epyc_avx2", "skylake_x"):
        monkeypatch.setattr(cpu_features, "read_cpu_features", lambda kind=kind: features(kind))
        monkeypatch.setattr(compilation, "read_cpu_features", lambda kind=kind: features(kind))
        isa = cpu_features.machine_isa()
        lib = toolchain.library_path("paged_attention", isa)
        assert isa == CPUS[kind][1] and f"-{isa}-" in lib.name
        cmd = toolchain.command("paged_attention", isa, lib)
        assert "-march=native" not in cmd and set(toolchain.ISA_FLAGS[isa]) <= set(cmd)
        names[kind] = (lib, compilation.inductor_cache_dir())
    assert len({n[0] for n in names.values()}) == 3 and len({n[1] for n in names.values()}) == 3
    assert names["epyc_avx2"][1].name.startswith("avx2-") and "x86-64-v3" in toolchain.ISA_FLAGS["avx2"][0]


@pytest.fixture(scope="module")
def lower_levels() -> None:
    """Every library at AVX2 and at the portable level, compiled side by side once: the capped runs
    below load them, and so does `make test-isa` after this file."""
    from models.native.toolchain import build_all, host_levels

    build_all([level for level in ("avx2", "generic") if level in host_levels()])


def _disassembly(path: Path) -> str:
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.caps
@pytest.mark.slow  # the first user of lower_levels: ~2 min of compiling on 2 cores, once per cache
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86 levels")
def test_lower_levels_hold_no_higher_instructions(lower_levels):
    """The AVX2 build has no AVX-512 register in it; the portable one no AVX at all."""
    from models.native.toolchain import build

    for name in ("paged_attention", "panel_linear"):
        avx2, generic = _disassembly(build(name, "avx2")), _disassembly(build(name, "generic"))
        assert "%ymm" in avx2 and "%zmm" not in avx2
        assert "%ymm" not in generic and "%zmm" not in generic


@pytest.mark.caps
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86 levels")
def test_only_the_tile_libraries_hold_tile_code():
    """At the amx level q8_linear is built with AMX's int8 tiles and paged_attention with its bf16 tiles
    (compiled here whatever the CPU: never run unless the tiles were granted); every other library
    loads its avx512_bf16 build."""
    from models.native.toolchain import SOURCES, TILE_LIBRARIES, build, build_level, flags

    assert TILE_LIBRARIES == {"q8_linear", "paged_attention"}
    for name in SOURCES:
        assert build_level(name, "amx") == ("amx" if name in TILE_LIBRARIES else "avx512_bf16")
        assert ("-mamx-tile" in flags(name, "amx")) == (name in TILE_LIBRARIES)
    code = _disassembly(build("q8_linear", "amx"))
    assert all(op in code for op in ("ldtilecfg", "tdpbssd", "tdpbsud", "tilerelease"))
    code = _disassembly(build("paged_attention", "amx"))
    assert all(op in code for op in ("ldtilecfg", "tdpbf16ps", "tilerelease"))
    for name in TILE_LIBRARIES:
        assert "tdpb" not in _disassembly(build(name, "avx512_bf16"))


@pytest.mark.caps
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86 levels")
def test_a_shared_cache_never_loads_another_cpus_kernel(tmp_path, lower_levels):
    """A cache directory shared with a machine of another level holds that machine's library
    (here: a file that cannot load, at the name this CPU's own level would use). A faked
    AVX2-only CPU loads its own AVX2 build and never touches it; the real CPU does try it."""
    from models.native.cpu_features import read_cpu_features
    from models.native.toolchain import build, library_path

    cache = tmp_path / "cache"
    own = library_path("paged_attention", "avx2")
    shared = cache / "native" / own.name
    shared.parent.mkdir(parents=True)
    shutil.copy(build("paged_attention", "avx2"), shared)  # the AVX2 machine's build
    top = read_cpu_features().isa  # uncapped: the subprocesses run at the CPU's own level
    # NOTE: on an AVX2-only CPU the other machine is an AVX-512 one (its file must not land on our own)
    other = "avx512" if top == "avx2" else top
    (cache / "native" / library_path("paged_attention", other).name).write_bytes(b"built elsewhere")
    fake_avx2 = ("import models.native.cpu_features as f\n"
                 f"f.read_cpu_features = lambda: f.parse_cpuinfo({CPUS['epyc_avx2'][0]!r}, 'x86_64')\n")
    probe = "from kvcache import ops; print(ops.CPU_BACKEND)"
    env = {"ATTNSERVE_CACHE_DIR": str(cache), "ATTNSERVE_CPU_ISA": "auto"}
    proc = _run(fake_avx2 + probe, env)
    assert proc.returncode == 0 and proc.stdout.split() == ["native-avx2"], proc.stderr[-2000:]
    assert "unavailable" not in proc.stderr
    if top != "avx2":  # the file at the real level's name is what this CPU would load: it fails, loudly
        proc = _run(probe, env)
        assert proc.stdout.split() == ["sdpa"] and "kernel is unavailable" in proc.stderr


@pytest.mark.caps
@pytest.mark.parametrize("cap", ["avx2", "generic"])
def test_a_capped_run_takes_the_capped_path(cap, lower_levels):
    """`attnserve env` under a cap: torch, oneDNN, our kernels and inductor's cache all at the cap."""
    proc = subprocess.run([sys.executable, "-m", "server.cli", "env", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "ATTNSERVE_CPU_ISA": cap})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["isa"]["chosen"] == cap and report["isa"]["cap"] == cap
    assert report["torch"]["cpu_capability"] == {"avx2": "AVX2", "generic": "DEFAULT"}[cap]
    assert "bfloat16" not in report["torch"]["onednn_packs"]  # oneDNN refuses bf16 below AVX-512
    assert report["kernels"]["attention"] == f"native-{cap}" and report["kernels"]["panel_linear"]
    assert all(f"-{cap}-" in lib["path"] for lib in report["kernels"]["libraries"].values())
    assert Path(report["inductor_cache"]).name.startswith(f"{cap}-")
    auto = report["paths"]["bfloat16 checkpoint, --dtype auto"]
    assert f"isa={cap} dtype=float32 weights=bfloat16 linear=panels attention=native-{cap}" in auto
    assert "without bf16 arithmetic" in report["paths"]["bfloat16 checkpoint, --dtype bfloat16"]


def test_env_prints_the_chosen_paths():
    proc = subprocess.run([sys.executable, "-m", "server.cli", "env"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for line in ("CPU: ", "ISA level: CPU ", "torch ", "oneDNN ", "compiler: ", "kernels: attention native-",
                 "inductor cache: ", "paths chosen here:", "bfloat16 checkpoint, --dtype auto: device=cpu isa=",
                 "quantized checkpoint, --activations exact: 4-bit codes exact, 8-bit codes exact",
                 "quantized checkpoint, --activations int8: 4-bit codes int8-"):
        assert line in out, line
    assert cpu_features.read_cpu_features().model in out


@pytest.mark.caps
@pytest.mark.slow
def test_bfloat16_on_an_avx2_cap_answers_with_one_line_saying_it_is_slower(default_model_dir, lower_levels):
    """The README's question with an explicit --dtype bfloat16 on a CPU without bf16 arithmetic."""
    proc = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--prompt", "What is the capital of France?",
                           "--chat", "--max-tokens", "16", "--dtype", "bfloat16", "--enforce-eager",
                           "--quantization", "none"],  # the bf16 panels path (the quantized default: test_cli_serve)
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ATTNSERVE_CPU_ISA": "avx2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("attnserve engine:")]
    assert len(lines) == 1 and "isa=avx2 dtype=bfloat16 weights=bfloat16 linear=panels" in lines[0]
    assert "without bf16 arithmetic" in lines[0]


@pytest.mark.caps
def test_processes_capped_early_and_late_share_a_compile_cache(tmp_path, lower_levels):
    """Under ATTNSERVE_CPU_ISA=avx2, a process that capped torch before it started and one whose
    torch started first (a script that imports torch before attnserve) compile into one cache
    through the engine's own compile_model: each gets its own directory and the right numbers.
    With one directory for both, each loaded the other's artifacts and produced zeros or a double
    free. (On an AVX2-only CPU the two processes' torch runs at the same level, so they share one
    directory.) NOTE: a step of a few fused ops, not a model: the directory is the subject, and
    compiling the engine's step under the cap is test_engine_greedy's (make test-isa's AVX2 pass)."""
    code = ("import os, sys\n"
            "if sys.argv[1] == 'late':\n"
            "    import torch; torch.ones(2).sum()  # torch's kernels start before the cap\n"
            "else:\n"
            "    from models.native.cpu_features import apply_isa_cap; apply_isa_cap()\n"
            "import torch\n"
            "from server.engine.compilation import compile_model, compiled_graphs, inductor_cache_dir\n"
            "class Step(torch.nn.Module):  # a linear, SiLU and an RMS norm: vectorised kernels of the cap's ISA\n"
            "    def forward(self, x, w):\n"
            "        h = torch.nn.functional.silu(x @ w)\n"
            "        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)\n"
            "g = torch.Generator().manual_seed(0)\n"
            "x, w, step = torch.randn(7, 64, generator=g), torch.randn(64, 96, generator=g), Step()\n"
            "got = compile_model(step)(x, w)\n"
            "print(inductor_cache_dir().name, compiled_graphs(), float((got - step(x, w)).abs().max()))\n")
    from models.native.cache import cache_dir

    (tmp_path / "native").symlink_to(cache_dir() / "native")  # NOTE: inductor's cache is the subject, not the kernels
    env = {"ATTNSERVE_CACHE_DIR": str(tmp_path), "ATTNSERVE_CPU_ISA": "avx2"}
    dirs = set()
    # NOTE: one of each is enough: had they one directory, the late process would load the early one's
    # artifacts (a cache hit) and answer wrong; that a warm start loads its own is test_bench_engine's
    for order in ("early", "late"):
        proc = _run(code, env, args=[order])
        assert proc.returncode == 0, proc.stderr[-3000:]
        name, graphs, error = proc.stdout.split()
        assert int(graphs) == 1 and float(error) < 1e-4, (order, graphs, error)
        dirs.add(name)
    # on an AVX2-only CPU torch starts at AVX2 either way: one directory is right there
    assert len(dirs) == (1 if cpu_features.read_cpu_features().isa == "avx2" else 2), dirs
    assert all(d.startswith("avx2-") for d in dirs)
    assert {d.name for d in (tmp_path / "inductor").iterdir()} == dirs  # where each compiled


@pytest.mark.caps  # the portable level's own check, beside its builds (~30 s of two cross compilers)
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="a cross-compile from x86")
def test_portable_kernels_compile_for_aarch64():
    """The portable build is plain C++ with vector extensions: it compiles for ARM too."""
    from concurrent.futures import ThreadPoolExecutor

    from models.native.toolchain import SOURCES, command

    cross = shutil.which("aarch64-linux-gnu-g++")
    assert cross, "aarch64-linux-gnu-g++ missing: `make test` installs Debian's g++-aarch64-linux-gnu"

    def compile_for_arm(name: str) -> subprocess.CompletedProcess:
        cmd = [cross, *(a for a in command(name, "generic", Path(os.devnull))[1:]
                        if a not in ("-shared", "-O3") and not a.startswith(("-l", "-L"))), "-O0", "-c"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one compiler per core
        for name, proc in zip(SOURCES, pool.map(compile_for_arm, SOURCES)):
            assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
