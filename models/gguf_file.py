"""GGUF reading: every tensor renamed to HF layout; quantized matrices kept as codes
(models/quant_formats.py) or dequantised to fp32.

Supports the `llama` GGUF architecture (Llama, Mistral, SmolLM...) and `qwen2`.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.checkpoint import HFCheckpoint

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of q/k weights."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def gguf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    model_type, cls = _ARCHITECTURES[arch]
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))},
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def _unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order `_unpermute` makes, for codes (whose rows move with their scales)."""
    return torch.from_numpy(_unpermute(np.arange(num_rows), num_heads).copy())


def read_gguf(path: Path, keep_quantized: bool = False) -> HFCheckpoint:
    """With `keep_quantized`, matrices of a type models/quant_formats.py reads stay quantized
    (`QuantizedTensor`); everything else is dequantised to fp32."""
    import gguf
    from tqdm import tqdm

    from models.quant_formats import SUPPORTED_GGUF_TYPES, from_gguf

    reader = gguf.GGUFReader(str(path))
    config = gguf_config(reader)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with rope_freqs (llama3 RoPE scaling) are not supported")
    permute = config["model_type"] == "llama"
    tensors: dict = {}
    for t in tqdm(reader.tensors, desc=f"reading {path.name}", unit="tensor", leave=False):
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"unexpected tensor {t.name!r} in {path}")
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
        heads = None
        if permute and ".self_attn.q_proj." in name:
            heads = config["num_attention_heads"]
        elif permute and ".self_attn.k_proj." in name:
            heads = config["num_key_value_heads"]
        if keep_quantized and t.tensor_type in SUPPORTED_GGUF_TYPES and len(shape) == 2:
            w = from_gguf(t.data, t.tensor_type, tuple(shape))
            tensors[name] = w if heads is None else w.select_rows(_unpermute_rows(shape[0], heads))
            continue
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if heads is not None:
            w = _unpermute(w, heads)
        tensors[name] = torch.tensor(w)  # copies out of the read-only memory map
    # NOTE: the dtype `--dtype auto` starts from: a file of quantized or 16-bit matrices is a 16-bit model
    wide = any(t.tensor_type == gguf.GGMLQuantizationType.F32 and len(t.shape) == 2 for t in reader.tensors)
    config["dtype"] = "float32" if wide else "bfloat16"
    return HFCheckpoint(config=config, tensors=tensors, source=path)


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer (with chat template) embedded in a GGUF file, via transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
