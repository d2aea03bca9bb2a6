"""Translate an HF `config.json` dict into our ModelConfig (and back, for kv-head edits)."""
from __future__ import annotations

from typing import Any

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig

_ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
}
LLAMA_FAMILY = ("llama", "mistral", "qwen2")


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


def _rope(hf: dict[str, Any]) -> RopeConfig:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
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


def _llama_family(hf: dict[str, Any], arch: str, eos: tuple[int, ...]) -> ModelConfig:
    heads = hf["num_attention_heads"]
    max_pos = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    if window and (arch == "mistral" or hf.get("use_sliding_window")):
        # NOTE: we do not implement sliding-window masks; capping the context at the window
        # makes every supported length exact instead of silently wrong past it.
        max_pos = min(max_pos, window)
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=max_pos,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        activation=_activation(hf.get("hidden_act", "silu")),
        position="rope",
        rope=_rope(hf),
        qkv_bias=True if arch == "qwen2" else bias,
        o_bias=False if arch == "qwen2" else bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
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
