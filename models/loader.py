"""Build a DecoderLM (and its tokenizer) from a checkpoint directory or a GGUF file."""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from models.checkpoint import read_checkpoint
from models.cpu_linear import prepare
from models.hf_checkpoint import HFCheckpoint
from models.hf_config import config_from_hf
from models.native.cpu_path import QUANTIZATIONS, int8_code_bits, resolve_dtype
from models.native.memory import release_freed_memory
from models.native.probe import detect
from models.parallel import shard_config, split
from models.quant_formats import QuantizedTensor, is_quantized, packed_bytes, quantize_rtn, rtn_bytes
from models.quant_linear import PACK_WEIGHTS, QuantEmbedding, QuantLinear, kind_runs, linear_mode, packed_bits
from models.registry import stored_gguf
from models.transformer import DecoderLM
from models.weights import hf_to_internal

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"unsupported dtype {name}; use float32 or bfloat16")
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use float32 or bfloat16")
    return DTYPES[name]


def model_from_checkpoint(ckpt: HFCheckpoint, dtype: torch.dtype = torch.float32, device: str = "cpu",
                          quantization: str = "none", shard=None, int8_bits: frozenset[int] = frozenset()) -> DecoderLM:
    """`quantization`: int8 / int4 / int4_g128 quantize the decoder layers' linears (round to
    nearest); embeddings and the LM head stay unquantized. Matrices the checkpoint holds quantized
    (a GGUF read with keep_quantized) stay so whatever it says; linears whose codes have `int8_bits`
    bits take int8 activations, the rest exact ones (models/quant_linear.py). With a `shard` (models/parallel.py)
    the model holds that rank's heads, features, vocabulary rows and layers only."""

    full = config_from_hf(ckpt.config, ckpt.generation_config)
    cfg = full if shard is None else shard_config(full, shard)
    packer = _Packer(dtype, device, quantization, int8_bits, cfg.tie_word_embeddings)
    # NOTE: a rank of a sharded model generates (embeddings are not served in parallel): it needs an LM head
    tensors = hf_to_internal(full, ckpt.tensors, shard, lm_head_optional=ckpt.base_model and shard is None,
                             convert=packer)
    quantized = {k: tensors.pop(k) for k in list(tensors) if isinstance(tensors[k], (QuantLinear, QuantizedTensor))}
    state = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    with _skeleton():
        if shard is None:
            model = DecoderLM(cfg)
        else:
            start, stop = split(cfg.vocab_size, shard.tp_size)[shard.tp_rank]
            layers = shard.layers(cfg.num_layers)
            model = DecoderLM(cfg, layers, stop - start)
            # NOTE: a stage's layers keep their numbers in the whole model (windows, KV slots): its
            # module list counts from 0
            state = {_local_layer(k, layers.start): v for k, v in state.items()}
            quantized = {_local_layer(k, layers.start): v for k, v in quantized.items()}
    if model.lm_head is not None and "lm_head.weight" not in state and "lm_head.weight" not in quantized:
        model.lm_head = None  # a base model's checkpoint without one: hidden states (embeddings) only
    for name, weight in quantized.items():
        _install_quantized(model, name.removesuffix(".weight"), weight, state, dtype, device)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    # NOTE: a quantized module's bias came in with its codes; nothing else may be left out
    missing = [k for k in missing if k.removesuffix(".bias") + ".weight" not in quantized]
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    if cfg.tie_word_embeddings and "embed.weight" not in quantized and model.embed is not None and \
            model.lm_head is not None:
        model.lm_head.weight = model.embed.weight
    # a fused matrix's kind lists its parts' ("Q4_K+Q6_K"): each format named once
    model.quantization = "+".join(sorted({k for w in quantized.values() for k in w.kind.split("+")})) or "none"
    model.set_rope_frequencies(device)
    return model.eval().requires_grad_(False)


class _Packer:
    """hf_to_internal's `convert`: each quantized matrix (a GGUF's, or one quantized here) becomes its
    QuantLinear as it arrives, in huge pages, so that loading holds the packed weights read so far and one
    chunk of one matrix unpacked (models/quant_linear.py pack_by_rows), never the whole model twice.
    Linears whose codes have `int8_bits` bits take int8 activations, the rest exact ones."""

    def __init__(self, dtype: torch.dtype, device: str, quantization: str, int8_bits: frozenset[int],
                 tied: bool) -> None:
        self.dtype, self.device, self.quantization, self.int8_bits, self.tied = dtype, device, quantization, int8_bits, tied
        self.table: QuantLinear | QuantizedTensor | None = None  # the embedding table, as converted

    def __call__(self, name: str, t):
        if self.quantization != "none" and name.startswith("layers.") and name.endswith("_proj.weight") \
                and not is_quantized(t):
            t = quantize_rtn(t.float(), _fitting_scheme(self.quantization, t.shape[1]))
        if not is_quantized(t):
            return t
        if name == "lm_head.weight" and self.tied and self.table is not None:
            return self.table  # NOTE: one rank's rows of both: held once
        if name == "embed.weight" and linear_mode(t, torch.device(self.device)) != "packed":
            self.table = t.materialize()  # rows gathered from the codes (QuantEmbedding); a tied head packs its own
            return self.table
        # NOTE: by the int8 kernel's form of each run of one type (a fused matrix of mixed types runs as its parts)
        forms = {packed_bits(r, True) for r in kind_runs(t) or [t]}
        activations = "int8" if forms <= self.int8_bits else "exact"
        linear = QuantLinear(t, None, self.dtype, self.device, activations)  # packed in huge pages, by rows
        if math.prod(t.shape) > PACK_WEIGHTS:  # NOTE: glibc keeps the chunks' pages otherwise (a 1B model: 310 MB)
            release_freed_memory()
        if name == "embed.weight":
            self.table = linear
        return linear


def _local_layer(name: str, first: int) -> str:
    if not name.startswith("layers."):
        return name
    _, i, rest = name.split(".", 2)
    return f"layers.{int(i) - first}.{rest}"


@contextmanager
def _skeleton() -> Iterator[None]:
    """Modules built on the meta device with nn.init skipped: every weight is assigned after.

    Measured: nn.init on meta tensors takes torch._refs' path, which imports torch._dynamo
    (1.2 s, and ~100 MB a process serving through server/engine/native_decoder.py never needs)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, _keep)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_")


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def _fitting_scheme(scheme: str, in_features: int) -> str:
    """int4_g128 where 128 divides the inputs, else the largest group of 64 or 32 that does
    (SmolLM2's 576 = 9 x 64): a matrix is never padded."""
    if scheme != "int4_g128" or in_features % 128 == 0:
        return scheme
    return "int4_g64" if in_features % 64 == 0 else "int4_g32"


def _install_quantized(model: DecoderLM, module_name: str, weight: QuantLinear | QuantizedTensor, state: dict,
                       dtype: torch.dtype, device: str) -> None:
    """A packed table (a GGUF's token_embd, tied or not) is read by rows out of its QuantLinear's panels
    (QuantEmbedding.tied), so it is held once, as the head's codes where they are tied."""
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if isinstance(getattr(parent, child), nn.Embedding):
        table = QuantEmbedding.tied(weight, dtype) if isinstance(weight, QuantLinear) else \
            QuantEmbedding(weight, dtype, device)
        setattr(parent, child, table)
        return
    if isinstance(weight, QuantizedTensor):  # a table that cannot be packed here, tied to this head
        weight = QuantLinear(weight, None, dtype, device, "exact")
    bias = state.pop(module_name + ".bias", None)
    if bias is not None:
        weight.bias = nn.Parameter(bias.to(device, dtype), requires_grad=False)
    setattr(parent, child, weight)


def load_model(path: str | Path, dtype: str | torch.dtype = torch.float32, device: str = "cpu") -> DecoderLM:
    """Load weights from safetensors or GGUF (never pickle). `path` is a directory or .gguf file."""
    return model_from_checkpoint(read_checkpoint(path), parse_dtype(dtype), device)


def read_model_config(path: str | Path):
    """A checkpoint's ModelConfig, its tensors unread."""
    ckpt = read_checkpoint(path, keep_quantized=True, lazy=True)
    return config_from_hf(ckpt.config, ckpt.generation_config)


def checkpoint_dtype(ckpt: HFCheckpoint) -> str:
    """The checkpoint's own dtype, which `--dtype auto` starts from: its config's, else its tensors'."""
    declared = str(ckpt.config.get("dtype") or ckpt.config.get("torch_dtype") or "auto").removeprefix("torch.")
    if declared != "auto":
        return declared
    first = next((t for t in ckpt.tensors.values() if t.is_floating_point()), None)
    return "float32" if first is None else str(first.dtype).removeprefix("torch.")


def serving_dtype(path: str | Path, dtype: str = "auto", device: str = "cpu") -> str:
    """The dtype `load_for_serving` computes in for this checkpoint here (`auto` resolved)."""

    return resolve_dtype(detect(device), dtype, checkpoint_dtype(read_checkpoint(path)), device)


def estimate_weight_bytes(ckpt: HFCheckpoint, dtype: torch.dtype, quantization: str = "none") -> int | None:
    """The weights' bytes as served, from a lazy checkpoint's shapes alone (nothing read); None where they are
    not known. GGUF matrices kept quantized as packed (packed_bytes: an upper bound, but for a fused matrix of
    mixed types on the exact kernel, which takes its widest part's form; the int8 kernel keeps each part's own);
    the rest in the compute dtype, or as `quantization` packs the layers' matrices."""
    shapes = getattr(ckpt.tensors, "shapes", None)
    if not shapes:
        return None
    total = 0
    for name, (shape, kind) in shapes.items():
        numel = math.prod(shape)
        if kind is not None:
            total += packed_bytes(kind, numel)
        elif name.endswith(("embed_tokens.weight", "wte.weight")) and ckpt.config.get("tie_word_embeddings"):
            total += 2 * numel * dtype.itemsize  # NOTE: a CPU path packs the tied head's copy for its matmuls
        elif quantization != "none" and len(shape) == 2 and ".layers." in f".{name}" and "norm" not in name:
            total += rtn_bytes(_fitting_scheme(quantization, shape[1]), *shape)
        else:
            total += numel * dtype.itemsize
    return total


def load_for_serving(path: str | Path, dtype: str = "auto", device: str = "cpu",
                     quantization: str = "auto", shard=None, activations: str = "auto",
                     fits: Callable[[int], None] | None = None) -> DecoderLM:
    """A model ready to serve here: in the dtype its CPU path computes in, with that path's
    linears swapped in (`model.cpu_path` says which; models/native/cpu_path.py chooses) and its weights
    quantized as asked (`model.quantization`, `model.weight_bytes()`), their activations as asked (auto:
    models/native/cpu_path.py `int8_code_bits`). Read tensor by tensor, each packed as it comes
    (_Packer); with a `shard`, that rank's part (its collectives are joined in by models.parallel.parallelize).
    `fits(bytes)`: called with the weights' estimated bytes before any is read; it raises where they cannot fit."""

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
    keep = quantization == "auto"  # a GGUF as stored; a model converted from one reads that file again
    ckpt = read_checkpoint((keep and stored_gguf(path)) or path, keep_quantized=keep, lazy=True)
    caps = detect(device)
    source = checkpoint_dtype(ckpt)
    compute = parse_dtype(resolve_dtype(caps, dtype, source, device))
    rtn = "none" if quantization in ("auto", "none") else quantization
    estimate = estimate_weight_bytes(ckpt, compute, rtn)
    if fits is not None and estimate is not None and shard is None:
        fits(estimate)
    model = model_from_checkpoint(ckpt, compute, device,
                                  rtn, shard, int8_code_bits(caps, activations))
    prepare(model, caps, dtype, source, device, activations)
    del ckpt
    release_freed_memory()
    return model
