"""The layers make lint holds (contracts in pyproject.toml), and the platform's promise that importing
compiles nothing."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    # NOTE: PYTHONPATH first: the copy's packages, not the editable install's, are the ones analysed
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_tree_keeps_its_layers():
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "4 kept, 0 broken" in proc.stdout


def test_an_import_against_the_layers_breaks_its_contract(tmp_path):
    """A copy of the tree with one wrong import per contract: each contract fails, by name."""
    for package in ("models", "kvcache", "server"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("csrc", "static", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    wrong = {
        "kvcache/block_pool.py": "import server.wire",  # kvcache above server
        "models/native/cache.py": "import models.config",  # the platform above another models module
        "server/engine/request.py": "import server.metrics",  # the engine on a Serve-facing module
        "server/wire.py": "import models.native.probe",  # torch on the wire, through a function-local import
    }
    for path, line in wrong.items():
        with open(tmp_path / path, "a") as f:
            f.write(f"\n{line}  # noqa\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    for contract in ("server above kvcache above models BROKEN",
                     "the CPU platform (models.native) at the bottom of models BROKEN",
                     "the engine knows nothing of Serve, HTTP or the metrics it feeds BROKEN",
                     "the wire carries plain data: no torch BROKEN"):
        assert contract in proc.stdout, proc.stdout[-3000:]


def test_importing_compiles_nothing(tmp_path):
    """Every module that calls a C++ library imports without building one (no compiler at all here):
    the first use builds, and the paged-attention op gets its CPU implementation from the first pool."""
    code = ("import kvcache.ops, kvcache.paged_attention, kvcache.storage, models.cpu_linear, models.quant_linear,"
            " models.shm_comm, models.native.probe, server.engine.native_decoder, server.engine.step\n"
            "import torch\n"
            "print(torch._C._dispatch_has_kernel_for_dispatch_key('attnserve::paged_attention', 'CPU'))\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "ATTNSERVE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False"]  # no CPU implementation registered yet: no pool asked
    assert "compiling" not in proc.stderr and "unavailable" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cache" / "native").exists()
