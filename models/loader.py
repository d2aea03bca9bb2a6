"""Build a DecoderLM (and its tokenizer) from a checkpoint directory or a GGUF file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.checkpoint import HFCheckpoint, read_checkpoint
from models.hf_config import config_from_hf
from models.rope import rope_inv_freq
from models.transformer import DecoderLM
from models.weights import hf_to_internal

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"unsupported dtype {name}; use float32 or bfloat16")
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use float32 or bfloat16")
    return DTYPES[name]


def model_from_checkpoint(ckpt: HFCheckpoint, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DecoderLM:
    cfg = config_from_hf(ckpt.config, ckpt.generation_config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in hf_to_internal(cfg, dict(ckpt.tensors)).items()}
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    if cfg.rope is not None:
        model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope).to(device)
    return model.eval().requires_grad_(False)


def load_model(path: str | Path, dtype: str | torch.dtype = torch.float32, device: str = "cpu") -> DecoderLM:
    """Load weights from safetensors or GGUF (never pickle). `path` is a directory or .gguf file."""
    return model_from_checkpoint(read_checkpoint(path), parse_dtype(dtype), device)


def checkpoint_dtype(ckpt: HFCheckpoint) -> str:
    """The checkpoint's own dtype, which `--dtype auto` starts from: its config's, else its tensors'."""
    declared = str(ckpt.config.get("dtype") or ckpt.config.get("torch_dtype") or "auto").removeprefix("torch.")
    if declared != "auto":
        return declared
    first = next((t for t in ckpt.tensors.values() if t.is_floating_point()), None)
    return "float32" if first is None else str(first.dtype).removeprefix("torch.")


def serving_dtype(path: str | Path, dtype: str = "auto", device: str = "cpu") -> str:
    """The dtype `load_for_serving` computes in for this checkpoint here (`auto` resolved)."""
    from models.cpu_path import detect, resolve_dtype

    return resolve_dtype(detect(device), dtype, checkpoint_dtype(read_checkpoint(path)), device)


def load_for_serving(path: str | Path, dtype: str = "auto", device: str = "cpu") -> DecoderLM:
    """A model ready to serve here: in the dtype its CPU path computes in, with that path's
    linears swapped in (`model.cpu_path` says which; models/cpu_path.py chooses)."""
    from models.cpu_path import detect, prepare, resolve_dtype

    ckpt = read_checkpoint(path)
    caps = detect(device)
    source = checkpoint_dtype(ckpt)
    model = model_from_checkpoint(ckpt, parse_dtype(resolve_dtype(caps, dtype, source, device)), device)
    prepare(model, caps, dtype, source, device)
    return model


def load_tokenizer(path: str | Path) -> Any:
    """HF fast tokenizer (with chat template) from a checkpoint directory or a GGUF file."""
    path = Path(path)
    if path.suffix == ".gguf":
        from models.gguf_file import gguf_tokenizer

        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
