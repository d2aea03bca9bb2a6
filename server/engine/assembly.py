"""An engine's parts, built once from its config: the model (here, or sharded over Ray workers), the
tokenizer, the KV pool and its manager, the runner, the draft proposer, and what they describe."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.manager import KVCacheManager
from kvcache.quant import dtype_name, kv_cache_dtype, scales_for
from kvcache.storage import KVCacheSpec, PagedKVCache
from models.config import ModelConfig
from models.cpu_linear import prepare
from models.loader import load_for_serving, parse_dtype, read_model_config
from models.lora import LoraSlots, lora_shapes
from models.native.cpu_path import CpuPath
from models.native.memory import available_memory
from models.native.probe import detect
from models.registry import resolve_model
from models.tokenizer import load_tokenizer
from models.transformer import DecoderLM
from server.engine.config import EngineConfig, format_size
from server.engine.executor import RayExecutor
from server.engine.model_runner import DistributedRunner, ModelRunner
from server.engine.pooling import BOTH, Pooling, resolve_pooling
from server.engine.proposers import DraftModelProposer, NgramProposer, Proposer, check_vocabulary
from server.engine.spec_config import SpeculativeConfig
from server.wire import ModelInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    model: DecoderLM | None  # None where the model is sharded over Ray workers (`executor`)
    tokenizer: Any
    model_config: ModelConfig
    cpu_path: CpuPath
    kv_spec: KVCacheSpec
    kv: KVCacheManager
    cache: PagedKVCache | None  # the pool, where the model runs in this process
    runner: ModelRunner
    executor: Any  # server.engine.executor.RayExecutor, or None
    spec: SpeculativeConfig | None
    proposer: Proposer | None
    info: ModelInfo
    eos_token_ids: frozenset[int]
    weight_bytes: int  # as served (quantized, packed), every rank's together
    pooling: Pooling | None = None  # an embedding model's (server/engine/pooling.py); None: it generates
    lora_slots: LoraSlots | None = None  # the LoRA adapters' weights (server/engine/lora_manager.py); None: off

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.info.num_blocks


def assemble(config: EngineConfig, model: DecoderLM | None = None, tokenizer: Any = None) -> EngineParts:
    """`model`: one the caller loaded (its dtype is the one asked for), else loaded here, or sharded."""
    if config.world_size > 1:
        return _assemble_parallel(config, tokenizer)
    given = Path(config.model).expanduser()
    path = resolve_model(config.model) if model is None else given if given.exists() else None
    pooling = resolve_pooling(path, config.task, config.pooling, config.embed_normalize)
    if model is None:
        model = load_for_serving(path, config.dtype, config.device, quantization=config.quantization,
                                 activations=config.activations,
                                 fits=lambda weight_bytes: config.check_fits(weight_bytes, available_memory()))
        tokenizer = tokenizer or load_tokenizer(path)
    else:
        dtype = dtype_name(model.dtype)
        prepare(model, detect(config.device), dtype, dtype, config.device, config.activations)
    if pooling is None or config.task == BOTH:
        _require_lm_head(model, config.model)
    if pooling is not None and config.max_loras:  # NOTE: task auto found an embedding model
        raise ValueError(f"{config.model} is an embedding model: LoRA adapters (max_loras) are not supported "
                         "with embeddings")
    _describe(model.cpu_path)
    spec = config.speculative_config
    draft = _load_draft(config, spec, model, tokenizer) if spec is not None and spec.method == "draft_model" else None
    kv_spec = KVCacheSpec.of(model.config, kv_cache_dtype(config.kv_cache_dtype, model.dtype), config.block_size)
    draft_spec = DraftModelProposer.kv_spec(draft, config.block_size) if draft is not None else None
    # weight_bytes is what the weights take as served (quantized, packed), LoRA slots included: with
    # kv_cache_memory auto the pool is memory_budget minus that, so every byte quantization saves becomes KV blocks
    slots = (LoraSlots(lora_shapes(model.config, config.max_loras, config.max_lora_rank), model.dtype, model.device)
             if config.max_loras else None)
    weight_bytes = model.weight_bytes() + (slots.nbytes() if slots is not None else 0)
    if slots is not None:
        logger.info("attnserve LoRA: %d adapter slots up to rank %d, %s (counted in the weights)", config.max_loras,
                    config.max_lora_rank, format_size(slots.nbytes()))
    if config.num_blocks:
        num_blocks = config.num_blocks
    else:
        # a draft model's weights and its KV (as many blocks as the target's, fewer bytes each) come
        # out of the same budget
        draft_block = draft_spec.bytes_per_block if draft is not None else 0
        budget = config.kv_budget(weight_bytes + (draft.weight_bytes() if draft is not None else 0), model.quantization,
                                  available_memory())
        num_blocks = _blocks_in(config, budget * kv_spec.bytes_per_block // (kv_spec.bytes_per_block + draft_block),
                                kv_spec.bytes_per_block, weight_bytes)
    _log_pool(config, model.cpu_path, weight_bytes, num_blocks, kv_spec)
    cache = PagedKVCache(kv_spec, num_blocks, model.device, scales_for(model, kv_spec.dtype, tokenizer))
    runner = ModelRunner(model, cache, compile=not config.enforce_eager, native=config.native_decoder,
                         lora_slots=slots)
    proposer = None
    if draft is not None:
        proposer = DraftModelProposer(ModelRunner(draft, PagedKVCache(draft_spec, num_blocks, draft.device),
                                                  compile=not config.enforce_eager, native=config.native_decoder),
                                      num_blocks, draft_spec)
    return _parts(config, model, tokenizer, model.config, model.cpu_path, kv_spec, num_blocks, cache, runner, None,
                  proposer, weight_bytes, pooling, slots)


def _assemble_parallel(config: EngineConfig, tokenizer: Any) -> EngineParts:
    """The model sharded over Ray workers (server/engine/executor.py); scheduling and sampling stay here.
    Each rank's pool gets what its budget leaves after its weights: the group has the fewest blocks any
    rank fits."""

    path = resolve_model(config.model)
    executor = RayExecutor(config)
    # NOTE: the ranks' steps take no prompt rows (DistributedRunner): every row on the int8 kernel
    cpu_path = dataclasses.replace(executor.cpu_path, prompt_activations="")
    _describe(cpu_path)
    tokenizer = tokenizer or load_tokenizer(path)
    cfg = read_model_config(path)
    kv_spec = KVCacheSpec.of(cfg, kv_cache_dtype(config.kv_cache_dtype, parse_dtype(cpu_path.dtype)), config.block_size)
    weight_bytes = sum(w.weight_bytes for w in executor.info)
    num_blocks = config.num_blocks or min(
        _blocks_in(config, config.kv_budget(w.weight_bytes, cpu_path.quantization), w.kv_bytes_per_block,
                   w.weight_bytes) for w in executor.info)
    _log_pool(config, cpu_path, weight_bytes, num_blocks, kv_spec)
    runner = DistributedRunner(executor, kv_spec, cfg.vocab_size, num_blocks)
    return _parts(config, None, tokenizer, cfg, cpu_path, kv_spec, num_blocks, None, runner, executor, None,
                  weight_bytes)


def _parts(config: EngineConfig, model, tokenizer, cfg: ModelConfig, cpu_path: CpuPath, kv_spec: KVCacheSpec,
           num_blocks: int, cache, runner, executor, draft_proposer, weight_bytes: int,
           pooling: Pooling | None = None, lora_slots: LoraSlots | None = None) -> EngineParts:
    logger.info("attnserve step: %s", runner.step)
    spec = config.speculative_config
    proposer = draft_proposer
    if spec is not None:
        proposer = proposer or NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        logger.info("attnserve speculative decoding: %s", spec)
    eos = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    info = ModelInfo(
        max_model_len=min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings),
        attention=cfg.attention_kind, num_kv_heads=cfg.num_kv_heads, kv_bytes_per_token=kv_spec.bytes_per_token,
        vocab_size=cfg.vocab_size, block_size=config.block_size, num_blocks=num_blocks, num_heads=cfg.num_heads,
        kv_cache_dtype=dtype_name(kv_spec.dtype), cpu_path=cpu_path, quantization=cpu_path.quantization,
        weight_bytes=weight_bytes, speculative=spec.method if spec is not None else None,
        layer_windows=cfg.layer_windows, kv_block_bytes=kv_spec.bytes_per_block,
        attention_variants=cfg.attention_variants, tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        workers=executor.info if executor is not None else (), scheduling_policy=config.scheduling_policy,
        task="generate" if pooling is None else BOTH if config.task == BOTH else "embed", pooling=pooling,
        hidden_size=cfg.hidden_size, lora=lora_slots.shapes if lora_slots is not None else None)
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, kv_spec.group_windows)
    return EngineParts(model=model, tokenizer=tokenizer, model_config=cfg, cpu_path=cpu_path, kv_spec=kv_spec, kv=kv,
                       cache=cache, runner=runner, executor=executor, spec=spec, proposer=proposer, info=info,
                       eos_token_ids=frozenset(eos), weight_bytes=weight_bytes, pooling=pooling, lora_slots=lora_slots)


def _describe(path: CpuPath) -> None:
    # one line says what this machine runs; at warning level when a slower choice was asked for
    logger.log(logging.WARNING if path.note else logging.INFO, "attnserve engine: %s", path.describe())


def _load_draft(config: EngineConfig, spec: SpeculativeConfig, model: DecoderLM, tokenizer: Any) -> DecoderLM:
    path = resolve_model(spec.model)
    draft = load_for_serving(path, config.dtype, config.device, quantization=spec.quantization,
                             activations=config.activations)
    _require_lm_head(draft, spec.model)
    check_vocabulary(model, tokenizer, draft, load_tokenizer(path), spec.model)
    logger.info("attnserve draft model %s: %s, weights %s", spec.model, draft.quantization,
                format_size(draft.weight_bytes()))
    return draft


def _require_lm_head(model: DecoderLM, name: str) -> None:
    """A model that generates needs logits; a base model's checkpoint may have no LM head (models/loader.py)."""
    if model.lm_head is None:
        raise ValueError(f"{name}: a base model's checkpoint with no LM head (no lm_head.weight, embeddings not "
                         "tied) cannot generate; it serves embeddings only (--task embed)")


def _blocks_in(config: EngineConfig, budget: int, block_bytes: int, weight_bytes: int) -> int:
    if budget < block_bytes:
        raise ValueError(f"KV budget of {budget} bytes is below one block ({block_bytes} bytes); weights "
                         f"{format_size(weight_bytes)}, memory_budget {_size(config.memory_budget)}, "
                         f"kv_cache_memory {config.kv_cache_memory}: raise memory_budget or kv_cache_memory, "
                         "or give num_blocks")
    return budget // block_bytes


def _size(value: int | str) -> str:
    return value if isinstance(value, str) else format_size(value)


def _log_pool(config: EngineConfig, cpu_path: CpuPath, weight_bytes: int, num_blocks: int, kv_spec: KVCacheSpec) -> None:
    logger.info("attnserve memory: weights %s (%s), KV pool %d blocks of %d tokens (%s)",
                format_size(weight_bytes), cpu_path.quantization, num_blocks, config.block_size,
                format_size(num_blocks * kv_spec.bytes_per_block))
