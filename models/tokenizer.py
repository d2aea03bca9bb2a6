"""The tokenizer of a checkpoint directory or a GGUF file."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from models.gguf_file import gguf_tokenizer
from models.native.cache import cache_dir, cache_lock
from models.native.memory import release_freed_memory

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path) -> Any:
    """HF fast tokenizer (with chat template) from a checkpoint directory or a GGUF file."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _cached_gguf_tokenizer(path)

    from transformers import AutoTokenizer, PretrainedConfig  # noqa: PLC0415 - transformers takes seconds to import: only where a tokenizer is built

    # where tokenizer_config.json names its class, a blank config keeps AutoTokenizer from
    # reading config.json with AutoConfig, which imports ~700 modules (accelerate, model code):
    # 50 MB of an engine process's memory, for nothing the tokenizer uses
    settings = path / "tokenizer_config.json"
    named = settings.exists() and bool(json.loads(settings.read_text()).get("tokenizer_class"))
    extra = {"config": PretrainedConfig()} if named else {}
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, **extra)
    release_freed_memory()  # building it leaves ~30 MB of freed Python objects in glibc's arenas
    return tokenizer


def _cached_gguf_tokenizer(path: Path) -> Any:
    """A GGUF's tokenizer, built once per file and saved in the cache: building it from the file's vocabulary
    (transformers' GGUF integration) took 2.7 s of every start of a 1B file (Zen 4), loading the saved one
    a fraction of it. The key is the file's path, size and mtime: a file rewritten gets a new entry."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    saved = cache_dir() / "gguf-tokenizers" / f"{path.stem}-{key}"
    if (saved / "tokenizer.json").exists():
        return load_tokenizer(saved)
    tokenizer = gguf_tokenizer(path)
    try:
        with cache_lock("gguf-tokenizers"):
            if not (saved / "tokenizer.json").exists():
                partial = saved.with_name(saved.name + f".partial-{os.getpid()}")
                tokenizer.save_pretrained(partial)
                partial.rename(saved)  # NOTE: whole or absent: a reader never sees a half-written directory
    except OSError as e:  # a read-only cache: built again next time
        logger.warning("attnserve: could not cache the tokenizer of %s: %s", path, e)
    return tokenizer
