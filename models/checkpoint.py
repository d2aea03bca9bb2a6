"""Read and write HF-layout checkpoints: config.json + safetensors (+ tokenizer files).

Only safetensors and GGUF are ever deserialised; pickle-based weights are refused.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.gguf_file import read_gguf
from models.hf_checkpoint import HFCheckpoint, LazyTensors
from models.hf_config import LLAMA_FAMILY
from models.lora_format import PICKLE_SUFFIXES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class UnsafeWeightsError(ValueError):
    """Raised for pickle-based weights, which can execute code when loaded."""


def _lazy_safetensors(files: list[Path]) -> LazyTensors:

    readers, shapes = {}, {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        readers.update({name: partial(handle.get_tensor, name) for name in handle.keys()})
        shapes.update({name: (tuple(handle.get_slice(name).get_shape()), None) for name in handle.keys()})
    return LazyTensors(readers, shapes)


def _refuse_pickle(path: Path) -> None:
    raise UnsafeWeightsError(
        f"refusing to load pickle weights at {path}: pickle can run arbitrary code. "
        "Convert the checkpoint to safetensors (or GGUF) first."
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    return sorted(directory.glob("*.safetensors"))


def _causal_lm_names(config: dict[str, Any], tensors: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A bare decoder's tensors (HF `AutoModel.save_pretrained`: `layers.0...`, `wte.weight`) under the names a
    `...ForCausalLM` gives them (`model.layers.0...`, `transformer.wte.weight`), which models/weights.py maps;
    None where they have those names already."""
    prefix = "model." if config.get("model_type") in LLAMA_FAMILY else "transformer."
    if any(name.startswith(prefix) for name in tensors):
        return None
    renamed = {name if name.startswith("lm_head.") else prefix + name: name for name in tensors}
    if isinstance(tensors, LazyTensors):
        return LazyTensors({new: tensors.readers[old] for new, old in renamed.items()},
                           {new: tensors.shapes[old] for new, old in renamed.items() if old in tensors.shapes})
    return {new: tensors[old] for new, old in renamed.items()}


def read_checkpoint(path: str | Path, keep_quantized: bool = False, lazy: bool = False) -> HFCheckpoint:
    """Load a checkpoint directory or a single .gguf file (its quantized matrices kept as codes
    with `keep_quantized`, else dequantised to fp32). `lazy`: tensors are read when looked up."""
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        _refuse_pickle(path)
    if path.suffix == ".gguf":
        return read_gguf(path, keep_quantized, lazy)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory or .gguf file at {path}")
    config_path = path / "config.json"
    files = safetensors_files(path)
    if not files:
        pickles = [p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            _refuse_pickle(pickles[0])
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 and not config_path.exists():
            return read_checkpoint(ggufs[0], keep_quantized, lazy)
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    if not config_path.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    tensors: Mapping[str, torch.Tensor] = _lazy_safetensors(files) if lazy else {}
    for f in files if not lazy else ():
        tensors.update(load_file(f))
    config = _read_json(config_path)
    renamed = _causal_lm_names(config, tensors)
    return HFCheckpoint(
        config=config,
        tensors=tensors if renamed is None else renamed,
        generation_config=_read_json(path / "generation_config.json"),
        source=path,
        base_model=renamed is not None,
    )


def write_checkpoint(ckpt: HFCheckpoint, out_dir: str | Path, tokenizer: Any | None = None,
                     dtype: torch.dtype | None = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer: loadable by transformers and by us."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in ckpt.tensors.items()}
    config = dict(ckpt.config)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if ckpt.generation_config:
        (out / "generation_config.json").write_text(json.dumps(ckpt.generation_config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    elif ckpt.source is not None and ckpt.source.is_dir():
        for name in TOKENIZER_FILES:
            if (ckpt.source / name).exists():
                (out / name).write_bytes((ckpt.source / name).read_bytes())
    return out
