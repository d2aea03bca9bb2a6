"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), read without
torch: the API layer checks an adapter against the served model before any replica loads it.

Errors (`AdapterError.status`): 404 where the directory, its adapter_config.json or its
adapter_model.safetensors is absent; 400 for everything present but unservable (pickle-only weights,
DoRA, modules_to_save, a bias, embedding or LM-head targets, a malformed header, a rank above the
cap, a shape of another base).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

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
    in_features: int = 0  # A's columns and B's rows, as the file has them
    out_features: int = 0


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


CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# weights that unpickle, which can run code: refused here and by models/checkpoint.py (one list, kept in
# this torch-free module so that the API layer can check adapters)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER = 100 << 20  # bytes: safetensors' own cap on the JSON header
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_SALT_DOMAIN = b"attnserve-lora\0"
_CHUNK = 1 << 20

# PEFT module name (its last one or two components) -> (our module, piece; None = every piece of the
# fused width). up_proj and GPT-2's c_fc are the up piece: 1 of a gated MLP, 0 of one without a gate.
TARGETS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", None),
    "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
    "gate_up_proj": ("gate_up", None), "down_proj": ("down", 0),
    "attn.c_attn": ("qkv", None), "attn.c_proj": ("o", 0), "mlp.c_fc": ("gate_up", 1), "mlp.c_proj": ("down", 0),
}
_UP = 1
# Config keys whose presence (truthy) means weights or math we do not serve
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "lora_bias": "a LoRA bias",
            "trainable_token_indices": "trainable tokens", "target_parameters": "target_parameters",
            "use_qalora": "QALoRA", "alora_invocation_tokens": "aLoRA"}
# The fields that change the math beside the tensors: part of the digest
_MATH_FIELDS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "fan_in_fan_out")
_KEY = re.compile(r"base_model\.model\.(?P<name>(?:.*\.)?(?:layers|h)\.(?P<layer>\d+)\.(?P<module>.+))"
                  r"\.lora_(?P<ab>[AB])\.weight")


def _safetensors_header(path: Path) -> dict[str, dict]:
    """The file's tensor table (name -> dtype, shape, data_offsets), parsed and bounded by hand: the
    file is someone else's, and this runs in the API process before any torch reads it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterError(f"{path.name}: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise AdapterError(f"{path.name}: header of {n} bytes (the file has {size})")
        try:
            table = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as e:
            raise AdapterError(f"{path.name}: header is not JSON ({e})") from None
    if not isinstance(table, dict):
        raise AdapterError(f"{path.name}: header is not a JSON object")
    table.pop("__metadata__", None)
    data = size - 8 - n
    for name, t in table.items():
        ok = isinstance(t, dict) and isinstance(t.get("shape"), list) and isinstance(t.get("data_offsets"), list)
        if not ok or not all(isinstance(d, int) and d >= 0 for d in [*t["shape"], *t["data_offsets"]]) \
                or len(t["data_offsets"]) != 2:
            raise AdapterError(f"{path.name}: malformed entry for {name!r}")
        if t.get("dtype") not in DTYPE_BYTES:
            raise AdapterError(f"{path.name}: {name} has dtype {t.get('dtype')!r}; served: {', '.join(DTYPE_BYTES)}")
        begin, end = t["data_offsets"]
        if not begin <= end <= data or end - begin != math.prod(t["shape"]) * DTYPE_BYTES[t["dtype"]]:
            raise AdapterError(f"{path.name}: {name}'s bytes do not match its shape")
    return table


def _pattern(patterns: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern rule (peft.utils.other.get_pattern_key): the first key that
    full-matches `(.*\\.)?{key}$` against the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _target(module: str) -> tuple[str, int | None]:
    parts = module.split(".")
    for name in (".".join(parts[-2:]), parts[-1]):
        if name in TARGETS:
            return TARGETS[name]
    raise AdapterError(f"LoRA on {module!r} is not served; targets: {', '.join(sorted(TARGETS))}")


def _digest(weights: Path, config: dict) -> bytes:
    """blake2b-128 over the weights' bytes and the config fields that change the math."""
    h = hashlib.blake2b(digest_size=16)
    with weights.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    h.update(json.dumps({k: config.get(k) for k in _MATH_FIELDS}, sort_keys=True).encode())
    return h.digest()


def _config(directory: Path) -> dict:
    if not directory.is_dir():
        raise AdapterError(f"no adapter directory at {directory}", status=404)
    path = directory / CONFIG
    if not path.is_file():
        raise AdapterError(f"no {CONFIG} in {directory}", status=404)
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise AdapterError(f"{CONFIG} is not JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"not a LoRA adapter (peft_type {config.get('peft_type')!r})"
                           if isinstance(config, dict) else f"{CONFIG} is not a JSON object")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise AdapterError(f"{what} adapters are not served ({key} in {CONFIG})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapters with bias={config['bias']!r} are not served; only bias='none'")
    for key in ("r", "lora_alpha"):
        if not _positive(config.get(key)):
            raise AdapterError(f"{CONFIG}: {key} must be a positive number")
    for key, default in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        config[key] = config.get(key) or {}
        if not isinstance(config[key], dict) or not all(_positive(v) for v in config[key].values()):
            raise AdapterError(f"{CONFIG}: {key} must map module names to positive numbers, as {default}")
    return config


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _weights(directory: Path) -> Path:
    path = directory / WEIGHTS
    if path.is_file():
        return path
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterError(f"pickle refused: {pickles[0]} can run code when loaded; save the adapter with "
                           "safe_serialization=True (adapter_model.safetensors)")
    raise AdapterError(f"no {WEIGHTS} in {directory}", status=404)


def read_adapter(path: str) -> AdapterSpec:
    """The adapter at `path` (a PEFT directory); the tensors in the file, not target_modules or
    layers_to_transform, say which modules it changes and at which rank."""
    directory = Path(path)
    config = _config(directory)
    weights = _weights(directory)
    table = _safetensors_header(weights)
    pairs: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for key, t in table.items():
        if "lora_embedding" in key or "lora_magnitude" in key:
            raise AdapterError(f"{key}: embedding and DoRA weights are not served")
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(f"{key}: not a LoRA weight of a decoder layer (embeddings and the LM head are not served)")
        pairs.setdefault(m["name"], {})[m["ab"]] = (key, t["shape"])
    deltas = []
    for name, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{name}: lora_A and lora_B come in pairs")
        (a_key, a_shape), (b_key, b_shape) = ab["A"], ab["B"]
        # NOTE: PEFT keeps lora_A / lora_B as nn.Linear weights (rank, in) / (out, rank) even on GPT-2's
        # Conv1D (fan_in_fan_out transposes only the base weight), so `transposed` stays False
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] == 0:
            raise AdapterError(f"{name}: lora_A {a_shape} and lora_B {b_shape} are not a (rank, in), (out, rank) pair")
        m = _KEY.fullmatch(a_key)
        module, piece = _target(m["module"])
        layer = int(m["layer"])
        r = _pattern(config["rank_pattern"], name, config["r"])
        alpha = _pattern(config["alpha_pattern"], name, config["lora_alpha"])
        if a_shape[0] != r:
            raise AdapterError(f"{name}: rank {a_shape[0]} in the file, {r} in {CONFIG}")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        deltas.append(ModuleDelta(layer, module, piece, r, float(scale), a_key, b_key,
                                  in_features=a_shape[1], out_features=b_shape[0]))
    if not deltas:
        raise AdapterError(f"{WEIGHTS} holds no LoRA weights")
    return AdapterSpec(str(directory), _digest(weights, config), max(d.rank for d in deltas), tuple(deltas))


def delta_pieces(delta: ModuleDelta, shapes: LoraShapes) -> tuple[int, ...] | None:
    """The pieces of `delta.module` that `delta` writes on a model of `shapes`; None where it has no such
    piece (gate_proj on an MLP without a gate)."""
    n = len(shapes.splits(delta.module))
    if delta.piece is None:
        return tuple(range(n))
    if delta.module == "gate_up" and not shapes.gated:
        return (0,) if delta.piece == _UP else None
    return (delta.piece,) if delta.piece < n else None


def check_adapter(spec: AdapterSpec, shapes: LoraShapes) -> None:
    """Raises AdapterError (400) where `spec` does not fit the served model of `shapes` or its slots."""
    if spec.max_rank > shapes.max_lora_rank:
        raise AdapterError(f"the adapter's rank {spec.max_rank} is above --max-lora-rank {shapes.max_lora_rank}")
    covered: set[tuple[int, str, int]] = set()
    for d in spec.deltas:
        if d.module not in MODULES:
            raise AdapterError(f"unknown module {d.module!r}")
        if not 0 <= d.layer < shapes.num_layers:
            raise AdapterError(f"the adapter has layer {d.layer}; the model has {shapes.num_layers}")
        pieces = delta_pieces(d, shapes)
        if pieces is None:
            raise AdapterError(f"layer {d.layer}'s {d.module} has no piece {d.piece} on this model ({shapes.architecture})")
        if covered & {(d.layer, d.module, p) for p in pieces}:
            raise AdapterError(f"layer {d.layer}'s {d.module}: two deltas on one piece (a fused and a split target?)")
        covered |= {(d.layer, d.module, p) for p in pieces}
        splits = shapes.splits(d.module)
        out = sum(splits[p] for p in pieces)
        if (d.in_features, d.out_features) != (shapes.in_features(d.module), out):
            raise AdapterError(f"layer {d.layer}'s {d.module}: the adapter is {d.in_features} -> {d.out_features}, "
                               f"the model {shapes.in_features(d.module)} -> {out}: an adapter of another base")
        if d.module == "qkv" and d.piece is None and shapes.architecture == "gpt_bigcode" \
                and shapes.q_size == shapes.kv_size:
            # NOTE: the MHA checkpoint's c_attn rows are interleaved per head (models/weights.py permutes them)
            raise AdapterError("LoRA on GPT-BigCode (MHA)'s fused c_attn is not served")


def cache_salt(digest: bytes) -> bytes:
    """The KV cache's salt for an adapter's blocks: from its digest, so a reload under the same name with
    other weights never meets stale KV."""
    return hashlib.blake2b(_SALT_DOMAIN + digest, digest_size=16).digest()
