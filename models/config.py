"""Model configuration: one frozen dataclass for every supported decoder-only architecture."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gpt2", "gpt_bigcode",
                           "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite_swa")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters, mirroring HF `rope_parameters` (default / linear / llama3)."""

    theta: float = 10000.0
    kind: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope type {self.kind!r}; supported: default, linear, llama3")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None) -> RopeConfig:
        params = dict(params or {})
        kind = params.get("rope_type", params.get("type", "default"))
        kw: dict[str, Any] = {"theta": float(params.get("rope_theta", 10000.0)), "kind": kind}
        if kind in ("linear", "llama3"):
            kw["factor"] = float(params["factor"])
        if kind == "llama3":
            kw["low_freq_factor"] = float(params["low_freq_factor"])
            kw["high_freq_factor"] = float(params["high_freq_factor"])
            kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        return cls(**kw)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and flavour of a decoder-only Transformer.

    MHA, GQA and MQA differ only in `num_kv_heads` (= num_heads, in between, = 1).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    # rmsnorm: cast, then scale (Llama); rmsnorm_fp32: scale, then cast (OLMo 2); gemma_rmsnorm: x (1 + w) in fp32
    norm: Literal["rmsnorm", "rmsnorm_fp32", "gemma_rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    activation: Literal["silu", "gelu", "gelu_tanh"] = "silu"
    position: Literal["rope", "learned"] = "rope"
    rope: RopeConfig | None = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Attention variants (docs/attention.md): all off is plain Llama attention
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window in tokens, None = global; () = all global
    # RMSNorm of q and k before RoPE: per head (Qwen3, Gemma 3) or over all heads at once (OLMo 2)
    qk_norm: Literal["none", "head", "all"] = "none"
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_softcap: float | None = None  # the same on the LM head's logits (Gemma 2)
    attn_scale: float | None = None  # softmax scale instead of 1/sqrt(head_dim): query pre-scale (Gemma, Granite)
    attn_sinks: bool = False  # a learned logit per head that takes a share of each softmax (gpt-oss, Granite SWA)
    block_norms: Literal["pre", "post", "sandwich"] = "pre"  # norm before (Llama), after (OLMo 2) or both (Gemma)
    embed_scale: float | None = None  # embeddings times this, rounded to the model's dtype first (Gemma, Granite)
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    logits_scaling: float | None = None  # LM-head logits divided by this (Granite)
    layer_ropes: tuple[RopeConfig | None, ...] = ()  # per layer where they differ: its RoPE, None = none (NoPE)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.norm not in ("rmsnorm", "rmsnorm_fp32", "gemma_rmsnorm", "layernorm"):
            raise ValueError(f"unknown norm {self.norm!r}")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"unknown mlp {self.mlp!r}")
        if self.activation not in ("silu", "gelu", "gelu_tanh"):
            raise ValueError(f"unknown activation {self.activation!r}")
        if self.position not in ("rope", "learned"):
            raise ValueError(f"unknown position embedding {self.position!r}")
        if self.position == "rope" and self.rope is None:
            raise ValueError("rope positions need a RopeConfig")
        if not math.isfinite(self.norm_eps) or self.norm_eps <= 0:
            raise ValueError("norm_eps must be positive")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError("a sliding window must be positive")
        if self.qk_norm not in ("none", "head", "all"):
            raise ValueError(f"unknown qk_norm {self.qk_norm!r}")
        if self.block_norms not in ("pre", "post", "sandwich"):
            raise ValueError(f"unknown block_norms {self.block_norms!r}")
        for name in ("attn_softcap", "final_softcap", "attn_scale", "embed_scale", "logits_scaling", "residual_scale"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive")
        if self.layer_ropes and (len(self.layer_ropes) != self.num_layers or self.position != "rope"):
            raise ValueError("layer_ropes needs rope positions and one entry per layer")

    @property
    def attention_kind(self) -> Literal["mha", "gqa", "mqa"]:
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for a global layer."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def is_windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def attention_variants(self) -> tuple[str, ...]:
        """Which departures from plain causal attention this model's layers make."""
        named = {"sliding_window": self.is_windowed, "qk_norm": self.qk_norm != "none",
                 "logit_softcap": self.attn_softcap is not None, "query_pre_scale": self.attn_scale is not None,
                 "sinks": self.attn_sinks}
        return tuple(name for name, on in named.items() if on)

    @property
    def attention_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def layer_rope(self, layer: int) -> RopeConfig | None:
        """Layer `layer`'s RoPE: the model's, or its own (Gemma 3's windowed layers, Granite SWA's NoPE)."""
        return self.layer_ropes[layer] if self.layer_ropes else self.rope

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element: every layer global."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size
