"""Map HF parameter names and layouts onto DecoderLM's (fused qkv, fused gate/up)."""
from __future__ import annotations

import torch

from models.config import ModelConfig
from models.hf_config import LLAMA_FAMILY
from models.parallel import shard_tensor
from models.quant_formats import QuantizedTensor, RowStack, concat_rows, is_quantized

# HF buffers that are not parameters (old GPT-2 checkpoints carry causal-mask buffers).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _pop(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise KeyError(f"checkpoint is missing tensor {name!r}")
    return hf.pop(name)


def _bigcode_mha_to_qkv(w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """GPTBigCode MHA interleaves q,k,v per head; regroup into [q | k | v] (bias too)."""
    h, d = cfg.num_heads, cfg.head_dim
    per_head = w.reshape(h, 3, d, *w.shape[1:])  # (H, 3, D, ...)
    return per_head.transpose(0, 1).reshape(w.shape)  # (3 * H * D, ...)


def _cat(parts: list) -> torch.Tensor:
    """Rows stacked (fused projections); quantized parts stay quantized, even of mixed types."""

    quantized = [is_quantized(p) for p in parts]
    if all(quantized):  # parts read by rows stay so: the stack is read a chunk at a time too
        return concat_rows(parts) if all(isinstance(p, QuantizedTensor) for p in parts) else RowStack(parts)
    if any(quantized):  # NOTE: a fused matrix has one format: a part stored unquantized makes it all dense
        parts = [p.materialize().dequantize() if q else p.float() for p, q in zip(parts, quantized)]
    return torch.cat(parts)


# Our norms -> HF's, by where the block puts them (models/transformer.py DecoderLayer)
_NORMS = {
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "post": {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
    "sandwich": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                 "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
}


def _fused_or_cat(hf: dict[str, torch.Tensor], fused: str, parts: list[str]) -> torch.Tensor:
    """A matrix the checkpoint stores fused already (Phi-3's qkv_proj, gate_up_proj), else its parts stacked."""
    return hf.pop(fused) if fused in hf else _cat([_pop(hf, p) for p in parts])


def _llama_layer(hf: dict[str, torch.Tensor], cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    for ours, theirs in _NORMS[cfg.block_norms].items():
        out[dst + f"{ours}.weight"] = _pop(hf, src + f"{theirs}.weight")
    if cfg.qk_norm != "none":
        out[dst + "attn.q_norm.weight"] = _pop(hf, src + "self_attn.q_norm.weight")
        out[dst + "attn.k_norm.weight"] = _pop(hf, src + "self_attn.k_norm.weight")
    if cfg.attn_sinks:
        out[dst + "attn.sinks"] = _pop(hf, src + "self_attn.sinks")
    for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
        out[dst + f"attn.qkv_proj.{kind}"] = _fused_or_cat(hf, src + f"self_attn.qkv_proj.{kind}",
                                                           [src + f"self_attn.{p}_proj.{kind}" for p in "qkv"])
    for kind in ("weight", "bias") if cfg.o_bias else ("weight",):
        out[dst + f"attn.o_proj.{kind}"] = _pop(hf, src + f"self_attn.o_proj.{kind}")
    for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
        out[dst + f"mlp.gate_up_proj.{kind}"] = _fused_or_cat(hf, src + f"mlp.gate_up_proj.{kind}",
                                                              [src + f"mlp.gate_proj.{kind}", src + f"mlp.up_proj.{kind}"])
        out[dst + f"mlp.down_proj.{kind}"] = _pop(hf, src + f"mlp.down_proj.{kind}")


def _gpt2_layer(hf: dict[str, torch.Tensor], cfg: ModelConfig, i: int, out: dict[str, torch.Tensor]) -> None:
    src, dst = f"transformer.h.{i}.", f"layers.{i}."
    conv1d = cfg.architecture == "gpt2"  # GPT-2 stores Conv1D weights as (in, out)
    names = {"attn.c_attn": "attn.qkv_proj", "attn.c_proj": "attn.o_proj",
             "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj",
             "ln_1": "attn_norm", "ln_2": "mlp_norm"}
    for hf_name, ours in names.items():
        for kind in ("weight", "bias"):
            t = _pop(hf, f"{src}{hf_name}.{kind}")
            if kind == "weight" and conv1d and not hf_name.startswith("ln"):
                t = t.t()
            if hf_name == "attn.c_attn" and cfg.architecture == "gpt_bigcode" and cfg.num_kv_heads > 1:
                t = _bigcode_mha_to_qkv(t, cfg)
            out[f"{dst}{ours}.{kind}"] = t


class _Remaining:
    """The checkpoint's tensors not used yet, read only when popped (a lazy checkpoint reads each
    from its file then: a rank's shard is cut from one matrix at a time)."""

    def __init__(self, tensors) -> None:
        self.tensors = tensors
        self.names = {k for k in tensors if not k.endswith(_IGNORED_SUFFIXES)}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __bool__(self) -> bool:
        return bool(self.names)

    def __iter__(self):
        return iter(self.names)

    def pop(self, name: str, *default):
        if name not in self.names:
            if default:
                return default[0]
            raise KeyError(name)
        self.names.remove(name)
        return self.tensors[name]


class _Kept(dict):
    """The state dict being built; with a shard, each tensor is cut to the rank's part as it arrives
    (so the whole fused matrix is dropped at once) and tensors the rank holds none of are left out.
    `convert(name, tensor)` then takes each as it arrives (the loader packs quantized matrices there), so
    no more than one matrix is held in its unpacked form at a time."""

    def __init__(self, cfg: ModelConfig, shard, convert=None) -> None:
        super().__init__()
        self.cfg, self.shard, self.convert = cfg, shard, convert

    def __setitem__(self, name: str, t) -> None:
        if self.shard is not None:
            whole = is_quantized(t) and not isinstance(t, RowStack)  # a stack is cut part by part (parallel._rows)
            t = shard_tensor(self.cfg, self.shard, name, t.materialize() if whole else t)
        if t is not None:
            super().__setitem__(name, t if self.convert is None else self.convert(name, t))


def hf_to_internal(cfg: ModelConfig, tensors, shard=None, lm_head_optional: bool = False, convert=None) -> dict:
    """Rename/fuse HF tensors into DecoderLM's state dict; every tensor must be used exactly once.

    With a `shard` (models/parallel.py): that rank's parts only, the tensors of other pipeline
    stages never read. `lm_head_optional`: a base model's checkpoint, which may have no LM head (and
    then the state dict has none). `convert(name, tensor)`: what the state dict keeps of each (_Kept)."""
    hf = _Remaining(tensors)
    out = _Kept(cfg, shard, convert)
    layers = range(cfg.num_layers) if shard is None else shard.layers(cfg.num_layers)
    llama = cfg.architecture in LLAMA_FAMILY
    table = "model.embed_tokens.weight" if llama else "transformer.wte.weight"
    first, last = layers.start == 0, layers.stop == cfg.num_layers
    if first or (last and cfg.tie_word_embeddings):
        embed = _pop(hf, table)
        out["embed.weight"] = embed
        if cfg.tie_word_embeddings:
            out["lm_head.weight"] = embed
    if llama:
        out["final_norm.weight"] = _pop(hf, "model.norm.weight")
        for i in layers:
            _llama_layer(hf, cfg, i, out)
    else:
        out["pos_embed.weight"] = _pop(hf, "transformer.wpe.weight")
        out["final_norm.weight"] = _pop(hf, "transformer.ln_f.weight")
        out["final_norm.bias"] = _pop(hf, "transformer.ln_f.bias")
        for i in layers:
            _gpt2_layer(hf, cfg, i, out)
    lm_head = hf.pop("lm_head.weight", None) if last else None
    if not cfg.tie_word_embeddings and last:
        if lm_head is None and not lm_head_optional:
            raise KeyError("checkpoint is missing tensor 'lm_head.weight' and does not tie embeddings")
        if lm_head is not None:
            out["lm_head.weight"] = lm_head
    if shard is not None:  # what other stages hold is theirs: unread here, not unused
        prefix = ("model.layers." if llama else "transformer.h.")
        hf.names = {k for k in hf.names if not (k.startswith(prefix) and int(k[len(prefix):].split(".")[0]) not in layers)
                    and k not in (table, "lm_head.weight")}
    if hf:
        raise KeyError(f"checkpoint has tensors this architecture does not use: {sorted(hf)[:8]}")
    return dict(out)
