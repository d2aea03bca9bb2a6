"""Translate an HF `config.json` dict into our ModelConfig (and back, for kv-head edits)."""
from __future__ import annotations

import dataclasses
from typing import Any

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig

_ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite_swa")
GEMMA = ("gemma2", "gemma3_text")


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


def _rope(hf: dict[str, Any], layer_type: str = "full_attention") -> RopeConfig:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if layer_type in params:  # per layer type (Gemma 3 in transformers 5)
        params = params[layer_type]
    elif layer_type == "sliding_attention":  # Gemma 3's older config.json: a plain RoPE of its own base
        params = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    params = dict(params)
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    return RopeConfig.from_hf(params)


def config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (+ generation_config.json for extra EOS ids)."""
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (architectures={hf.get('architectures')}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    eos = _eos_ids(hf.get("eos_token_id"), (generation or {}).get("eos_token_id"))
    if arch in LLAMA_FAMILY:
        return _llama_family(hf, arch, eos)
    return _gpt2_family(hf, arch, eos)


def _layer_types(hf: dict[str, Any], arch: str) -> list[str]:
    """Each layer's "full_attention" or "sliding_attention", as transformers derives them when
    config.json does not list them."""
    num_layers = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    if not hf.get("sliding_window"):
        return ["full_attention"] * num_layers
    if arch in ("qwen2", "qwen3"):  # the layers from max_window_layers on slide, if at all
        first = hf.get("max_window_layers", num_layers) if hf.get("use_sliding_window") else num_layers
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if arch in GEMMA:  # every `pattern`-th layer global
        pattern = hf.get("sliding_window_pattern", 2 if arch == "gemma2" else 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if arch == "granite_swa":  # every fourth layer global, from the first
        return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers  # mistral, phi3: a window on every layer


def _variants(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The attention variants config.json asks for (docs/attention.md)."""
    types = _layer_types(hf, arch)
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}")
    windows = tuple(hf["sliding_window"] if t == "sliding_attention" else None for t in types)
    out: dict[str, Any] = {"layer_windows": windows if any(windows) else ()}
    if arch in ("qwen3", "gemma3_text"):
        out["qk_norm"] = "head"
    if arch == "olmo2":
        out.update(qk_norm="all", block_norms="post", norm="rmsnorm_fp32")
    if arch in GEMMA:
        pre_scalar = hf.get("query_pre_attn_scalar")
        out.update(norm="gemma_rmsnorm", block_norms="sandwich", embed_scale=hf["hidden_size"] ** 0.5,
                   attn_scale=pre_scalar ** -0.5 if pre_scalar else None,
                   attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"))
    if arch == "gemma3_text" and any(windows):  # the sliding layers' own RoPE
        local = _rope(hf, "sliding_attention")
        out["layer_ropes"] = tuple(local if t == "sliding_attention" else _rope(hf) for t in types)
    if arch == "granite_swa":
        out.update(_granite(hf))
    return out


def _granite(hf: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers (1 = none), learned sinks, and a RoPE base per layer (0 = NoPE)."""
    def unless_one(key: str) -> float | None:
        value = float(hf.get(key, 1.0))
        return None if value == 1.0 else value

    out: dict[str, Any] = {"attn_sinks": True, "attn_scale": float(hf.get("attention_multiplier", 1.0)),
                           "embed_scale": unless_one("embedding_multiplier"),
                           "logits_scaling": unless_one("logits_scaling"),
                           "residual_scale": float(hf.get("residual_multiplier", 1.0))}
    thetas = hf.get("layer_rope_theta")
    if thetas:
        rope = _rope(hf)
        out["layer_ropes"] = tuple(dataclasses.replace(rope, theta=float(t)) if t else None for t in thetas)
    return out


def _llama_family(hf: dict[str, Any], arch: str, eos: tuple[int, ...]) -> ModelConfig:
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    return ModelConfig(
        architecture=arch,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        activation=_activation(activation),
        position="rope",
        rope=_rope(hf),
        qkv_bias=True if arch == "qwen2" else bias,
        o_bias=False if arch == "qwen2" else bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
        **{"norm": "rmsnorm", **_variants(hf, arch)},
    )


def _gpt2_family(hf: dict[str, Any], arch: str, eos: tuple[int, ...]) -> ModelConfig:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported")
    if hf.get("scale_attn_weights", True) is False:
        raise ValueError("GPT-2 without scale_attn_weights is not supported")
    hidden, heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(
        architecture=arch,
        num_layers=hf["n_layer"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=1 if arch == "gpt_bigcode" and hf.get("multi_query", True) else heads,
        head_dim=hidden // heads,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf["n_positions"],
        norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        mlp="gelu",
        activation=_activation(hf.get("activation_function", "gelu_new")),
        position="learned",
        rope=None,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
    )


def with_kv_heads(hf: dict[str, Any], num_kv_heads: int) -> dict[str, Any]:
    """A copy of an HF config dict describing the same model with `num_kv_heads` K/V heads."""
    out = dict(hf)
    if hf.get("model_type") == "gpt_bigcode":
        if num_kv_heads not in (1, hf["n_head"]):
            raise ValueError(f"gpt_bigcode supports only 1 (MQA) or {hf['n_head']} (MHA) kv heads")
        out["multi_query"] = num_kv_heads == 1
    else:
        out["num_key_value_heads"] = num_kv_heads
    return out
