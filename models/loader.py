"""Build a DecoderLM (and its tokenizer) from a checkpoint directory or a GGUF file."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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
from models.quant_formats import QuantizedTensor, quantize_rtn
from models.quant_linear import QuantEmbedding, QuantLinear, move_to_huge_pages
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
    # NOTE: a rank of a sharded model generates (embeddings are not served in parallel): it needs an LM head
    tensors = hf_to_internal(full, ckpt.tensors, shard, lm_head_optional=ckpt.base_model and shard is None)
    if cfg.tie_word_embeddings and "embed.weight" in tensors and "lm_head.weight" in tensors:
        tensors["lm_head.weight"] = tensors["embed.weight"]  # NOTE: one rank's rows of both: held once
    if quantization != "none":
        for name, t in tensors.items():
            if name.startswith("layers.") and name.endswith("_proj.weight") and not isinstance(t, QuantizedTensor):
                tensors[name] = quantize_rtn(t.float(), _fitting_scheme(quantization, t.shape[1]))
    quantized = {k: tensors.pop(k) for k in list(tensors) if isinstance(tensors[k], QuantizedTensor)}
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
        activations = "int8" if weight.bits in int8_bits else "exact"
        _install_quantized(model, name.removesuffix(".weight"), weight, state, dtype, device, activations)
    _share_tied_table(model, quantized, dtype)
    move_to_huge_pages(model)
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


def _install_quantized(model: DecoderLM, module_name: str, weight, state: dict, dtype: torch.dtype,
                       device: str, activations: str) -> None:

    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if isinstance(getattr(parent, child), nn.Embedding):
        setattr(parent, child, QuantEmbedding(weight, dtype, device))
    else:
        setattr(parent, child, QuantLinear(weight, state.pop(module_name + ".bias", None), dtype, device, activations))


def _share_tied_table(model: DecoderLM, quantized: dict, dtype: torch.dtype) -> None:
    """A tied GGUF table (embed and lm_head one QuantizedTensor): the embedding reads the packed
    head's panels, so the codes are held once."""

    table = quantized.get("embed.weight")
    if table is None or quantized.get("lm_head.weight") is not table or model.lm_head.mode != "packed":
        return
    model.embed = QuantEmbedding.tied(model.lm_head, dtype)


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


def load_for_serving(path: str | Path, dtype: str = "auto", device: str = "cpu",
                     quantization: str = "auto", shard=None, activations: str = "auto") -> DecoderLM:
    """A model ready to serve here: in the dtype its CPU path computes in, with that path's
    linears swapped in (`model.cpu_path` says which; models/native/cpu_path.py chooses) and its weights
    quantized as asked (`model.quantization`, `model.weight_bytes()`), their activations as asked (auto:
    models/native/cpu_path.py `int8_code_bits`). With a `shard`, that rank's
    part, read tensor by tensor (its collectives are joined in by models.parallel.parallelize)."""

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
    keep = quantization == "auto"  # a GGUF as stored; a model converted from one reads that file again
    ckpt = read_checkpoint((keep and stored_gguf(path)) or path, keep_quantized=keep, lazy=shard is not None)
    caps = detect(device)
    source = checkpoint_dtype(ckpt)
    model = model_from_checkpoint(ckpt, parse_dtype(resolve_dtype(caps, dtype, source, device)), device,
                                  "none" if quantization in ("auto", "none") else quantization, shard,
                                  int8_code_bits(caps, activations))
    prepare(model, caps, dtype, source, device, activations)
    del ckpt
    release_freed_memory()
    return model
