"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), read without
torch: the API layer checks an adapter against the served model before any replica loads it."""
from __future__ import annotations

from dataclasses import dataclass

# Our fused linears in layer order, and each one's pieces: the slices of its output that PEFT's
# separate modules write (q|k|v of qkv_proj, gate|up of gate_up_proj; a non-gated MLP has up only)
MODULES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class LoraShapes:
    """What an adapter is checked against: the served model's linear shapes and the replica's slots."""

    architecture: str
    num_layers: int
    hidden_size: int
    q_size: int  # num_heads x head_dim
    kv_size: int  # num_kv_heads x head_dim
    intermediate_size: int
    gated: bool
    max_loras: int
    max_lora_rank: int

    def splits(self, module: str) -> tuple[int, ...]:
        """The output widths of `module`'s pieces, in order."""
        return {"qkv": (self.q_size, self.kv_size, self.kv_size), "o": (self.hidden_size,),
                "gate_up": (self.intermediate_size,) * (2 if self.gated else 1),
                "down": (self.hidden_size,)}[module]

    def in_features(self, module: str) -> int:
        return {"qkv": self.hidden_size, "o": self.q_size, "gate_up": self.hidden_size,
                "down": self.intermediate_size}[module]


@dataclass(frozen=True)
class ModuleDelta:
    """One PEFT (lora_A, lora_B) pair: delta(x) = scale * (x @ A.T) @ B.T on piece `piece` of `module`
    (None: every piece at once, for a fused PEFT target such as Phi-3's qkv_proj)."""

    layer: int
    module: str  # one of MODULES
    piece: int | None
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    a_key: str  # safetensors keys: A (rank, in), B (out, rank)
    b_key: str
    transposed: bool = False  # fan_in_fan_out (GPT-2's Conv1D): A is (in, rank), B (rank, out)


@dataclass(frozen=True)
class AdapterSpec:
    path: str  # the adapter's directory
    digest: bytes  # of its weights and of the config fields that change the math: the KV cache's salt
    max_rank: int
    deltas: tuple[ModuleDelta, ...]

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(sorted({(d.module, d.piece) for d in self.deltas}, key=str))


class AdapterError(ValueError):
    """An adapter that cannot be served; `status` is the HTTP status it answers with."""

    def __init__(self, message: str, status: int = 400, param: str = "lora_path") -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def read_adapter(path: str) -> AdapterSpec:
    raise NotImplementedError


def check_adapter(spec: AdapterSpec, shapes: LoraShapes) -> None:
    raise NotImplementedError


def cache_salt(digest: bytes) -> bytes:
    raise NotImplementedError
