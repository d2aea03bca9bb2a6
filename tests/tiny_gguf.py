"""A tiny Llama whose every K is a multiple of 256 (so K-quants fit), written as a mixed-type GGUF the way
llama.cpp's convert_hf_to_gguf.py lays it out, plus an HF checkpoint of exactly the weights that GGUF holds
(its blocks dequantized by gguf.quants, q/k rows put back in HF order) for transformers to run as reference.

Written from llama.cpp's conventions (tensor names, metadata keys, the q/k row permutation), not from
models/gguf_file.py, so that a mistake in the reader shows up as a mismatch.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from tests.gguf_blocks import quantize_blocks
from tests.tiny import train_tokenizer

ARCH = "llama"
# Every type models/quant_formats.py decodes: keys are a GGUF name's part ("attn_q": every layer's) or a
# whole name without ".weight" ("blk.1.attn_output": that layer's only, which wins).
MIXED = {"attn_q": T.Q4_K, "attn_k": T.Q6_K, "attn_v": T.Q8_0, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
         "ffn_up": T.Q5_K, "ffn_down": T.Q5_0, "token_embd": T.Q8_0, "output": T.Q6_K, "blk.1.attn_output": T.Q5_1}

# HF name (inside model.layers.{i}.) -> llama.cpp's (inside blk.{i}.); tensor_mapping.py's names
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def make_tiny_llama_256(out: Path, seed: int = 0) -> Path:
    """A random HF Llama: hidden 256, intermediate 512, 2 layers, 4 heads / 2 KV heads (head_dim 64),
    untied embeddings, default RoPE, norms not all ones; tests/tiny.py's trained tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = train_tokenizer()
    eos, bos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=eos, bos_token_id=bos, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # a norm read wrongly (or not at all) must change the outputs
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def gguf_name(hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight; lm_head.weight -> output.weight."""
    stem, _, kind = hf_name.rpartition(".")
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:])]}.{kind}"
    return f"{_GLOBAL[stem]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half q/k rows -> llama.cpp's interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_dir(out_dir: Path) -> Path:
    """Where `write_tiny_gguf` puts the HF checkpoint of the GGUF's dequantized weights."""
    return out_dir.parent / f"{out_dir.name}-reference"


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def write_tiny_gguf(out_dir: Path, hf_dir: Path, types: dict[str, T]) -> Path:
    """`out_dir/model.gguf` (returned) from the HF Llama at `hf_dir`: each 2-D weight quantized to
    types[its GGUF name without ".weight", e.g. "blk.1.attn_q"], else types[its part, e.g. "attn_q"] (F32
    where `types` has neither), 1-D norms F32, q/k rows
    permuted as llama.cpp does; the tokenizer files beside it (and no config.json, so the directory reads as
    the GGUF). `reference_dir(out_dir)`: config.json + fp32 safetensors of the GGUF's weights dequantized."""
    import gguf
    from safetensors.torch import save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and not cfg.get("tie_word_embeddings", False), cfg
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden = cfg["hidden_size"]
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    assert rope.get("rope_type", "default") == "default", rope  # no llama3 scaling: the reader refuses rope_freqs

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_name("tiny-llama-256")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])

    reference: dict[str, torch.Tensor] = {}
    for name, t in sorted(_hf_tensors(hf_dir).items()):
        w = t.float().numpy()
        g = gguf_name(name)
        n_head = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else None
        if n_head is not None:
            w = permute(w, n_head)
        stem = g.removesuffix(".weight")
        kind = types.get(stem, types.get(stem.split(".")[-1])) if w.ndim == 2 else None
        if kind is None or kind == T.F32:
            writer.add_tensor(g, np.ascontiguousarray(w, dtype=np.float32))
            stored = w
        else:
            raw = quantize_blocks(w, kind)
            writer.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=kind)
            stored = np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32).reshape(w.shape)
        if n_head is not None:
            stored = unpermute(stored, n_head)
        reference[name] = torch.from_numpy(np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _copy_tokenizer(hf_dir, out_dir)

    ref = reference_dir(out_dir)
    ref.mkdir(parents=True, exist_ok=True)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(hf_dir / "config.json", ref / "config.json")
    _copy_tokenizer(hf_dir, ref)
    return path
