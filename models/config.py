"""Model configuration: one frozen dataclass for every supported decoder-only architecture."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gpt2", "gpt_bigcode")


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
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
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
        if self.norm not in ("rmsnorm", "layernorm"):
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

    @property
    def attention_kind(self) -> Literal["mha", "gqa", "mqa"]:
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size
