"""The tokenizer of a checkpoint directory or a GGUF file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.gguf_file import gguf_tokenizer
from models.native.memory import release_freed_memory


def load_tokenizer(path: str | Path) -> Any:
    """HF fast tokenizer (with chat template) from a checkpoint directory or a GGUF file."""
    path = Path(path)
    if path.suffix == ".gguf":

        return gguf_tokenizer(path)

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
