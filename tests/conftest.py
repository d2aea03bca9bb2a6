import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny import ARCHS, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint per supported architecture (llama is sharded)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: make_checkpoint(root / arch, arch, max_shard_size="100KB" if arch == "llama" else None)
        for arch in ARCHS
    }


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once to the cache."""
    from models.registry import ensure_default

    return ensure_default()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
