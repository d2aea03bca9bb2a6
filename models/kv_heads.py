"""Change a checkpoint's number of K/V heads: repeat to expand, mean-pool to shrink (GQA paper).

Query head j reads K/V head j // (num_heads / num_kv_heads). A new K/V head is the average
of the old heads its query heads used to read, so expanding is an exact copy and
shrinking is the Ainslie et al. (2023) mean-pool of each group.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from models.checkpoint import read_checkpoint, write_checkpoint
from models.hf_checkpoint import HFCheckpoint
from models.hf_config import LLAMA_FAMILY, config_from_hf, with_kv_heads
from models.tokenizer import load_tokenizer


def kv_sources(num_heads: int, old_kv: int, new_kv: int) -> list[Counter[int]]:
    """For each new K/V head: old head index -> number of its query heads that read it."""
    if num_heads % new_kv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of the new kv heads ({new_kv})")
    old_group, new_group = num_heads // old_kv, num_heads // new_kv
    return [Counter(q // old_group for q in range(i * new_group, (i + 1) * new_group)) for i in range(new_kv)]


def regroup_heads(w: torch.Tensor, num_heads: int, old_kv: int, new_kv: int) -> torch.Tensor:
    """(old_kv * D, ...) K or V projection rows -> (new_kv * D, ...)."""
    heads = w.reshape(old_kv, w.shape[0] // old_kv, *w.shape[1:])  # (Hkv_old, D, ...)
    out = []
    for sources in kv_sources(num_heads, old_kv, new_kv):
        if len(sources) == 1:  # expansion: copy bit for bit
            out.append(heads[next(iter(sources))])
        else:
            total = sum(sources.values())
            pooled = sum(heads[j].float() * (n / total) for j, n in sources.items())
            out.append(pooled.to(w.dtype))
    return torch.stack(out).reshape(new_kv * heads.shape[1], *w.shape[1:])


def _convert_bigcode(t: torch.Tensor, h: int, d: int, old_kv: int, new_kv: int) -> torch.Tensor:
    if old_kv == 1:
        q, k, v = t.split([h * d, d, d])
    else:  # MHA layout interleaves q, k, v per head
        per_head = t.reshape(h, 3, d, *t.shape[1:])  # (H, 3, D, ...)
        q, k, v = (per_head[:, i].reshape(h * d, *t.shape[1:]) for i in range(3))
    k, v = regroup_heads(k, h, old_kv, new_kv), regroup_heads(v, h, old_kv, new_kv)
    if new_kv == 1:
        return torch.cat([q, k, v])
    parts = [x.reshape(h, 1, d, *t.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * h * d, *t.shape[1:])  # (H, 3, D, ...) interleaved


def convert_kv_heads(ckpt: HFCheckpoint, num_kv_heads: int, progress: bool = True) -> HFCheckpoint:

    cfg = config_from_hf(ckpt.config)
    if num_kv_heads < 1:
        raise ValueError("--kv-heads must be at least 1")
    new_config = with_kv_heads(ckpt.config, num_kv_heads)
    if cfg.architecture in ("phi3", "olmo2"):
        # NOTE: phi3 stores k/v fused with q; olmo2 normalises k over all its heads at once (a new head
        # count changes that norm)
        raise ValueError(f"converting kv heads of {cfg.architecture} is not supported")
    h, d, old_kv = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
    kv_sources(h, old_kv, num_kv_heads)  # validates divisibility
    tensors = dict(ckpt.tensors)
    for i in tqdm(range(cfg.num_layers), desc=f"kv heads {old_kv} -> {num_kv_heads}", disable=not progress):
        for kind in ("weight", "bias"):
            if cfg.architecture in LLAMA_FAMILY:
                for p in ("k_proj", "v_proj"):
                    name = f"model.layers.{i}.self_attn.{p}.{kind}"
                    if name in tensors:
                        tensors[name] = regroup_heads(tensors[name], h, old_kv, num_kv_heads)
            else:
                name = f"transformer.h.{i}.attn.c_attn.{kind}"
                tensors[name] = _convert_bigcode(tensors[name], h, d, old_kv, num_kv_heads)
    return HFCheckpoint(config=new_config, tensors=tensors,
                        generation_config=ckpt.generation_config, source=ckpt.source)


def convert(src: str | Path, num_kv_heads: int, out_dir: str | Path, dtype: torch.dtype | None = None,
            progress: bool = True) -> Path:
    """Read SRC (directory or GGUF), regroup K/V heads, write an HF checkpoint to out_dir."""

    src = Path(src)
    ckpt = read_checkpoint(src)
    if ckpt.config.get("model_type") == "gpt2":
        raise ValueError("gpt2 has no kv-head setting in transformers; convert llama, mistral, qwen2, qwen3, "
                         "gemma2, gemma3_text or gpt_bigcode")
    converted = convert_kv_heads(ckpt, num_kv_heads, progress)
    tokenizer = load_tokenizer(src) if src.suffix == ".gguf" else None
    return write_checkpoint(converted, out_dir, tokenizer=tokenizer, dtype=dtype)
