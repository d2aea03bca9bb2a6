"""GGUF reading: every tensor renamed to HF layout; quantized matrices kept as codes
(models/quant_formats.py) or dequantised to fp32. What the converter did to the weights (undone
here) and what a file cannot say (assumed here, as llama.cpp assumes it): docs/gguf.md.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from models.hf_checkpoint import HFCheckpoint, LazyTensors
from models.native.memory import drop_mapped_pages
from models.quant_formats import SUPPORTED_GGUF_TYPES, GGUFRows

# GGUF architecture -> (HF model_type, HF class)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "granite_swa": ("granite_swa", "GraniteSWAForCausalLM"),
}
_PERMUTED = ("llama", "granite_swa")  # LlamaModel and its subclasses (GraniteModel) permute q / k
_GEMMA = ("gemma2", "gemma3")

# llama.cpp's name inside blk.{i}. -> HF's inside model.layers.{i}.
_BASE = {
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
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_POST_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "pre_feedforward_layernorm", **_POST_NORMS}
_LAYER_NAMES = {
    "llama": _BASE,
    "qwen2": _BASE,
    "qwen3": {**_BASE, **_QK_NORM},
    "gemma2": {**_BASE, **_GEMMA_NORMS},
    "gemma3": {**_BASE, **_GEMMA_NORMS, **_QK_NORM},
    "phi3": {**_BASE, "attn_qkv": "self_attn.qkv_proj"},  # ffn_up: see _targets
    "olmo2": {k: v for k, v in {**_BASE, **_QK_NORM, **_POST_NORMS}.items() if k not in ("attn_norm", "ffn_norm")},
    "granite_swa": {**_BASE, "attn_sinks": "self_attn.sinks"},  # HF's sinks have no ".weight"
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 LongRoPE: into the config


class GGUFReader(gguf.GGUFReader):
    """gguf-py's reader, slicing a plain array over its memory map instead of the np.memmap itself.

    NOTE: each np.memmap slice pays its __array_finalize__ (~4 us), and the stock reader makes three
    per string of the tokenizer's arrays: 2.7 s of every start of the default model (98k strings),
    0.7 s this way (Zen 4). Same fields and tensors (tests/test_default_model.py
    test_our_gguf_reader_reads_what_gguf_py_reads), views of the same map."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: Any) -> float:
    """A float GGUF stored as float32, as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of q/k weights."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _swa_layers(reader: Any, arch: str, num_layers: int, default_pattern: int) -> list[bool]:
    """Which layers slide, as llama.cpp's load_swa_pattern reads them: the file's per-layer array, else
    every `n`-th layer global (n from the file, else the architecture's default; n = 0: all slide)."""
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries, not {num_layers}")
        return [bool(p) for p in pattern]
    n = default_pattern if pattern is None else int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(num_layers)]


def _rope(reader: Any, arch: str, head_dim: int, tensors: dict[str, Any]) -> dict[str, Any]:
    """HF `rope_parameters` (one set: the global layers') from the file's rope keys."""

    key = f"{arch}.rope."
    theta = _f32(_field(reader, key + "freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = _field(reader, key + "scaling.type")
    factor = _field(reader, key + "scaling.factor") or _field(reader, key + "scale_linear")
    if kind in (None, "none") and factor and factor != 1.0:
        kind = "linear"  # old files: rope.scale_linear alone
    if kind == "linear":
        rope.update(rope_type="linear", factor=_f32(factor))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=_f32(factor),
                    original_max_position_embeddings=int(_field(reader, key + "scaling.original_context_length")))
        for hf_name, gguf_name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                                   ("attention_factor", "yarn_attn_factor"),
                                   ("extrapolation_factor", "yarn_ext_factor")):
            value = _field(reader, key + "scaling." + gguf_name)
            if value is not None:
                rope[hf_name] = _f32(value)
    elif kind == "longrope" or _ROPE_FACTORS[0] in tensors:
        rope["rope_type"] = "longrope"
        for name, hf_name in zip(_ROPE_FACTORS, ("long_factor", "short_factor")):
            t = tensors[name]
            rope[hf_name] = [_f32(v) for v in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
    elif kind not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
    rope_dim = int(_field(reader, key + "dimension_count", head_dim))
    if rope_dim != head_dim or arch == "phi3":  # Phi-3's config.json always says it
        rope["partial_rotary_factor"] = rope_dim / head_dim
    return rope


def gguf_config(reader: Any) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 spellings) for the file's model; see the module docstring
    for what the file cannot say."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    model_type, cls = _ARCHITECTURES[arch]

    def kv(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    heads = int(kv("attention.head_count"))
    hidden = int(kv("embedding_length"))
    num_layers = int(kv("block_count"))
    head_dim = int(kv("attention.key_length", hidden // heads))
    if int(kv("attention.value_length", head_dim)) != head_dim:
        raise ValueError("GGUF files whose value heads differ in size from key heads are not supported")
    embed = tensors["token_embd.weight"]
    config: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(kv("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(kv("context_length")),
        "rms_norm_eps": _f32(kv("attention.layer_norm_rms_epsilon")),
        "rope_parameters": _rope(reader, arch, head_dim, tensors),
        "vocab_size": int(embed.shape[-1]),  # GGUF lists dims innermost first: (hidden, vocab)
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    names = set(tensors)
    if arch != "qwen2":  # Qwen2 always has q/k/v biases and no attention_bias key
        config["attention_bias"] = any(re.fullmatch(r"blk\.\d+\.attn_(q|qkv|output)\.bias", n) for n in names)
    if arch in _PERMUTED:
        config["mlp_bias"] = any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.bias", n) for n in names)
    window = kv("attention.sliding_window")
    if arch in ("qwen2", "qwen3"):  # nothing written: full attention, as llama.cpp runs it
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers,
                      layer_types=["full_attention"] * num_layers)
    elif arch == "phi3":
        config["sliding_window"] = int(window) if window else None
        original = kv("rope.scaling.original_context_length")
        if original is not None:
            config["original_max_position_embeddings"] = int(original)
    elif arch == "granite_swa":
        config.update(_granite(reader, arch, config))
    elif arch == "olmo2" and window:
        raise ValueError("an olmo2 GGUF with a sliding window is OLMo 3, which is not supported")
    elif arch in _GEMMA:
        del config["hidden_act"]
        config["hidden_activation"] = "gelu_pytorch_tanh"
        if arch == "gemma2":
            window = int(window) if window is not None else 4096  # llama.cpp's default
        slides = _swa_layers(reader, arch, num_layers, 2 if arch == "gemma2" else 6) if window else [False] * num_layers
        config["sliding_window"] = int(window) if window else None
        config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
        big = num_layers == (46 if arch == "gemma2" else 62)  # llama.cpp's 27B, scaled by hidden / heads
        config["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        softcap = kv("attn_logit_softcapping", 50.0 if arch == "gemma2" else None)
        config["attn_logit_softcapping"] = _f32(softcap) if softcap else None
        softcap = kv("final_logit_softcapping", 30.0 if arch == "gemma2" else None)
        config["final_logit_softcapping"] = _f32(softcap) if softcap else None
        local = kv("rope.freq_base_swa")
        if arch == "gemma3" or local is not None:  # sliding layers: their own base (llama.cpp's default), unscaled
            local = _f32(local if local is not None else 10000.0)
            config["rope_parameters"] = {"full_attention": config["rope_parameters"],
                                         "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return config


def _granite(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """GraniteSWA's multipliers (llama.cpp's `*_scale` keys), window, sliding layers and NoPE layers."""
    def kv(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    n = config["num_hidden_layers"]
    slides = kv("attention.sliding_window_pattern") or [i % 4 != 0 for i in range(n)]  # the converter's default
    ropes = kv("attention.rope_pattern") or [True] * n  # llama.cpp: every layer, one base
    theta = config["rope_parameters"]["rope_theta"]
    scale = kv("attention.scale")  # absent: llama.cpp's 1/sqrt(head_dim), not HF's default 1
    return {
        "attention_multiplier": _f32(scale) if scale else config["head_dim"] ** -0.5,
        "embedding_multiplier": _f32(kv("embedding_scale") or 1.0),
        "residual_multiplier": _f32(kv("residual_scale") or 1.0),
        "logits_scaling": _f32(kv("logit_scale", 1.0)),
        "sliding_window": int(kv("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
        "layer_rope_theta": [theta if r else 0 for r in ropes],
    }


def _targets(name: str, arch: str, config: dict[str, Any],
             names: set[str]) -> list[tuple[str, slice | None, int | None]]:
    """(HF name, the rows of the GGUF tensor it takes or None for all, heads to unpermute or None)."""
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return [(f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}", None, None)]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m:
        raise ValueError(f"unexpected tensor {name!r}")
    i, part, kind = m.groups()
    prefix = f"model.layers.{i}."
    permute = arch in _PERMUTED
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if part == "attn_qkv" and arch != "phi3":  # --fuse-qkv: [q | k | v] rows
        q, k = heads * config["head_dim"], kv_heads * config["head_dim"]
        return [(f"{prefix}self_attn.q_proj.{kind}", slice(0, q), heads if permute else None),
                (f"{prefix}self_attn.k_proj.{kind}", slice(q, q + k), kv_heads if permute else None),
                (f"{prefix}self_attn.v_proj.{kind}", slice(q + k, None), None)]
    if arch == "phi3" and part == "ffn_up" and f"blk.{i}.ffn_gate.weight" not in names:
        return [(f"{prefix}mlp.gate_up_proj.{kind}", None, None)]  # Phi-3's fused gate | up
    layer_names = _LAYER_NAMES[arch]
    if part not in layer_names:
        raise ValueError(f"unexpected tensor {name!r} for GGUF architecture {arch!r}")
    unpermute = {"attn_q": heads, "attn_k": kv_heads}.get(part) if permute else None
    if part == "attn_sinks":
        return [(f"{prefix}{layer_names[part]}", None, None)]
    return [(f"{prefix}{layer_names[part]}.{kind}", None, unpermute)]


def _unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order `_unpermute` makes, for codes (whose rows move with their scales)."""
    return torch.from_numpy(_unpermute(np.arange(num_rows), num_heads).copy())


def read_gguf(path: Path, keep_quantized: bool = False, lazy: bool = False) -> HFCheckpoint:
    """With `keep_quantized`, matrices of a type models/quant_formats.py reads stay quantized
    (`QuantizedTensor`); everything else is dequantised to fp32. `lazy`: each tensor is decoded
    from the memory map when looked up (models.hf_checkpoint.LazyTensors)."""

    reader = GGUFReader(str(path))
    config = gguf_config(reader)
    arch = _field(reader, "general.architecture")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with rope_freqs (llama3 RoPE scaling) are not supported")
    names = {t.name for t in reader.tensors}
    readers: dict = {}
    shapes: dict = {}
    for t in reader.tensors:
        if t.name in _ROPE_FACTORS:
            continue  # in the config's rope_parameters
        try:
            targets = _targets(t.name, arch, config, names)
        except ValueError as e:
            raise ValueError(f"{e} in {path}") from None
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
        kept = keep_quantized and t.tensor_type in SUPPORTED_GGUF_TYPES and len(shape) == 2
        for name, rows, heads in targets:
            readers[name] = functools.partial(_decode, t, arch, rows, heads, keep_quantized, lazy)
            part = shape if rows is None else [len(range(*rows.indices(shape[0]))), *shape[1:]]
            shapes[name] = (tuple(part), t.tensor_type if kept else None)
    tensors = LazyTensors(readers, shapes) if lazy else {
        name: read() for name, read in tqdm(readers.items(), desc=f"reading {path.name}", unit="tensor", leave=False)}
    # the dtype `--dtype auto` starts from: a file of quantized or 16-bit matrices is a 16-bit model
    wide = any(t.tensor_type == gguf.GGMLQuantizationType.F32 and len(t.shape) == 2 for t in reader.tensors)
    config["dtype"] = "float32" if wide else "bfloat16"
    return HFCheckpoint(config=config, tensors=tensors, source=path)


def _decode(t: Any, arch: str, rows: Any, heads: int | None, keep_quantized: bool, lazy: bool) -> Any:
    """One target of GGUF tensor `t`: its rows (a fused matrix's part), un-permuted for `heads`. `lazy`: a
    quantized matrix is read a chunk of rows at a time by whoever takes it (GGUFRows)."""
    shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
    if keep_quantized and t.tensor_type in SUPPORTED_GGUF_TYPES and len(shape) == 2:
        data = t.data if rows is None else t.data[rows]  # NOTE: rows are whole runs of blocks: decode only them
        order = None if heads is None else _unpermute_rows(len(data), heads)
        source = GGUFRows(data, t.tensor_type, shape[1], order)
        return source if lazy else source.materialize()
    try:
        return _dequantize(t, arch, rows, heads, shape)
    finally:
        drop_mapped_pages(t.data)


def _dequantize(t: Any, arch: str, rows: Any, heads: int | None, shape: list[int]) -> torch.Tensor:
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    if arch in _GEMMA and t.name.endswith("norm.weight"):
        w = w - np.float32(1)  # the converter stored HF's Gemma norm + 1
    part = w if rows is None else w[rows]
    if heads is not None:
        part = _unpermute(part, heads)
    return torch.tensor(part)  # copies out of the read-only memory map


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer (with chat template) embedded in a GGUF file, via transformers."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - transformers takes seconds to import: only where a GGUF's tokenizer is built

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
