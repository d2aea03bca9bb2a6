"""Engine configuration: one frozen dataclass, validated on construction. No torch: the CLI and
the API layer read its defaults."""
from __future__ import annotations

import re
from dataclasses import dataclass

from models.native.cpu_path import ACTIVATIONS, DTYPES, QUANTIZATIONS
from server.engine.pooling import POOLING_CHOICES, TASKS
from server.engine.spec_config import SpeculativeConfig
from server.reasoning import CHOICES as REASONING_PARSERS

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 1GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _positive_size(name: str, value: int | str) -> int:
    try:
        size = parse_size(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if size <= 0:
        raise ValueError(f"{name} must be positive, not {value!r}")
    return size


AUTO_KV_POOL = int(1.5 * 2**30)  # memory_budget auto: the largest KV pool it sizes
MIN_AUTO_KV_POOL = 256 * 2**20  # ... and the least a model must leave room for to start
HEADROOM = 512 * 2**20  # activations, the tokenizer, compiled graphs: beyond weights and pool


def format_size(n: int) -> str:
    """Bytes for people: '1.50 GiB', '135.3 MiB', '512 B'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n} B"


CUDA_BLOCK_SIZE = 256
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # auto: the model's dtype; fp8: 8-bit floats, scaled
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy (server/engine/scheduler.py)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    dtype: str = "auto"  # auto: the checkpoint's where this CPU computes it natively (models/native/cpu_path.py)
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    # weights: auto keeps a GGUF's stored types (safetensors: unquantized), none dequantizes, int8 per
    # output channel, int4 in groups of 32, int4_g128 in groups of 128 (models/native/cpu_path.py)
    quantization: str = "auto"
    # the quantized linears' activations: exact, int8 (rounded per block of 32, integer dot products),
    # or auto (int8 where measured faster and within the perplexity bounds: models/native/cpu_path.py)
    activations: str = "auto"
    # weights + KV pool, when kv_cache_memory is auto. auto: what this machine or container has left
    # (models/native/memory.py available_memory), the pool up to AUTO_KV_POOL of it; a model that cannot
    # fit is refused before any weight is read (check_fits)
    memory_budget: int | str = "auto"
    # auto: the KV pool gets memory_budget - the weights' bytes as served (LLMEngine), so lighter
    # weights buy more blocks; a size (e.g. 1GiB) is the pool itself; ignored when num_blocks is given
    kv_cache_memory: int | str | None = "auto"
    num_blocks: int | None = None
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max positions
    max_waiting: int | None = None  # bounded waiting queue; None = unbounded
    # fcfs: arrival order; priority: each request's `priority` (lower first) orders admission and preemption
    scheduling_policy: str = "fcfs"
    num_threads: int | None = None  # torch intra-op threads for the step; None = torch's default
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: run the model eagerly, without torch.compile
    # True: native_decoder.py runs the layers of a model it covers (RMSNorm + RoPE + SwiGLU,
    # packed quantized linears) in one C++ call; False: they are compiled as every other model is
    native_decoder: bool = True
    # speculative decoding (server/engine/spec_config.py): JSON text, a mapping or a SpeculativeConfig; None: off
    speculative_config: SpeculativeConfig | dict | str | None = None
    device: str = "cpu"
    # a model larger than one worker (server/engine/executor.py): its layers' heads and features over
    # tensor_parallel_size ranks, its layers over pipeline_parallel_size stages, each rank a Ray actor of
    # worker_cpus CPUs (fractions fit a small machine) running num_threads threads (default round(worker_cpus));
    # memory_budget / kv_cache_memory are then per rank
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    worker_cpus: float = 1.0
    # reasoning models (server/reasoning.py): deepseek_r1, qwen3, auto (from the chat template) or None;
    # the thinking tokens a request may take before `</think>` is forced when it names no budget (-1: unlimited)
    reasoning_parser: str | None = None
    reasoning_budget: int = -1
    # what the model serves (server/engine/pooling.py): generate, embed (/v1/embeddings: pooled hidden states),
    # generate,embed (both), or auto (embed for a sentence-transformers checkpoint); an embedding model's
    # pooling (auto: the checkpoint's, else last) and L2 normalisation (None: the checkpoint's, else on)
    task: str = "auto"
    pooling: str = "auto"
    embed_normalize: bool | None = None
    # LoRA adapters (server/engine/lora_manager.py): slots for max_loras resident adapters of rank up to
    # max_lora_rank, in the model's compute dtype, out of memory_budget; 0: LoRA off (no slots, no memory)
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {self.activations!r}")
        if self.memory_budget != "auto":
            object.__setattr__(self, "memory_budget", _positive_size("memory_budget", self.memory_budget))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.num_blocks is None:
            if self.kv_cache_memory is None:
                raise ValueError("give kv_cache_memory (a size or auto) or num_blocks")
            if self.kv_cache_memory != "auto":
                object.__setattr__(self, "kv_cache_memory", _positive_size("kv_cache_memory", self.kv_cache_memory))
        elif self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        # NOTE: every running sequence must fit one decode token per step, so decodes never starve.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"not {self.scheduling_policy!r}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError("num_threads must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.worker_cpus <= 0:
            raise ValueError("worker_cpus must be positive")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, not {self.reasoning_parser!r}")
        if not isinstance(self.reasoning_budget, int) or self.reasoning_budget < -1:
            raise ValueError("reasoning_budget must be -1 (unlimited) or a token count >= 0")
        if self.task not in TASKS or self.pooling not in POOLING_CHOICES:
            raise ValueError(f"task must be one of {', '.join(TASKS)} and pooling one of {', '.join(POOLING_CHOICES)}")
        if self.world_size > 1 and self.task in ("embed", "generate,embed"):
            raise ValueError("embeddings (task embed) are not supported with tensor or pipeline parallelism")
        if self.world_size > 1 and self.kv_cache_dtype != "auto":
            raise ValueError("an 8-bit KV cache (kv_cache_dtype) is not supported with tensor or pipeline "
                             "parallelism: its scales are calibrated on the whole model")
        spec = self.speculative_config
        if self.world_size > 1 and spec is not None and spec.method == "draft_model":
            raise ValueError("a draft model (speculative_config) is not supported with tensor or pipeline "
                             "parallelism; the ngram method is")
        if self.max_loras < 0 or self.max_lora_rank <= 0:
            raise ValueError("max_loras must be >= 0 (0: LoRA off) and max_lora_rank positive")
        if self.max_loras and self.world_size > 1:
            raise ValueError("LoRA adapters (max_loras) are not supported with tensor or pipeline parallelism")
        if self.max_loras and self.task in ("embed", "generate,embed"):
            raise ValueError("LoRA adapters (max_loras) are not supported with embeddings (task embed): "
                             "an adapter changes what the model generates, not what it pools")
        # NOTE: on CUDA, attention reads the pool with Flash's paged kernel, whose pages are 256 tokens
        if self.device.startswith("cuda") and self.block_size % CUDA_BLOCK_SIZE:
            raise ValueError(f"on CUDA block_size must be a multiple of {CUDA_BLOCK_SIZE} (Flash's paged KV kernel)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def worker_threads(self) -> int:
        return self.num_threads or max(1, round(self.worker_cpus))

    def kv_budget(self, weight_bytes: int, weights_format: str | None = None, available: int | None = None) -> int:
        """The KV pool's bytes for a model whose weights take `weight_bytes` as served (in
        `weights_format`, e.g. int8): kv_cache_memory when it is a size, else memory_budget - weight_bytes,
        or with memory_budget auto up to AUTO_KV_POOL of what is `available` now (the weights loaded),
        less HEADROOM. Unused when num_blocks is given."""
        if self.kv_cache_memory != "auto":
            return int(self.kv_cache_memory)
        if self.memory_budget == "auto":
            left = AUTO_KV_POOL if available is None else min(AUTO_KV_POOL, available - HEADROOM)
            if left <= 0:
                raise ValueError(
                    f"no memory left for a KV cache: the weights take {format_size(weight_bytes)} as served and "
                    f"this machine (or container) has {format_size(available)} left, less "
                    f"{format_size(HEADROOM)} for activations; quantize the weights (--quantization int4) or "
                    "run where there is more memory")
            return left
        left = self.memory_budget - weight_bytes
        if left <= 0:
            raise self._no_room(f"{weight_bytes} bytes ({format_size(weight_bytes)}) as served (quantization "
                                f"{weights_format or self.quantization!r})")
        return left

    def _no_room(self, weights: str) -> ValueError:
        return ValueError(
            f"memory_budget ({self.memory_budget} bytes, {format_size(self.memory_budget)}) leaves no room for a KV "
            f"cache: the model's weights take {weights}; raise memory_budget (--memory-budget), quantize the weights "
            "(--quantization int8 / int4), or size the pool yourself with kv_cache_memory or num_blocks")

    def check_fits(self, weight_bytes: int, available: int | None) -> None:
        """Before loading: the weights (`weight_bytes`, estimated from the checkpoint's shapes) must leave
        room for a KV pool in memory_budget, and weights and pool must fit in what this machine or container
        has `available`, with HEADROOM for activations; else a clear error now, before anything is allocated
        (the loader would be killed for memory, or fail only once the weights are in)."""
        if self.num_blocks is None and self.kv_cache_memory == "auto" and self.memory_budget != "auto" \
                and weight_bytes >= self.memory_budget:
            raise self._no_room(f"about {weight_bytes} bytes ({format_size(weight_bytes)}) as served (estimated "
                                f"from the checkpoint, quantization {self.quantization!r})")
        if available is None:
            return
        if self.num_blocks:
            pool = 0  # its bytes follow from the model's geometry: checked by the pool's own allocation
        elif self.kv_cache_memory != "auto":
            pool = int(self.kv_cache_memory)
        elif self.memory_budget != "auto":
            pool = max(0, self.memory_budget - weight_bytes)
        else:
            pool = MIN_AUTO_KV_POOL
        need = weight_bytes + pool + HEADROOM
        if need > available:
            raise ValueError(
                f"{self.model} does not fit in memory: it needs {format_size(need)} (weights "
                f"{format_size(weight_bytes)} as served, estimated from the checkpoint; KV pool {format_size(pool)}; "
                f"{format_size(HEADROOM)} for activations) and this machine (or container) has "
                f"{format_size(available)} available. Quantize the weights (--quantization int4, or a smaller GGUF "
                "type), shrink the pool (--kv-cache-memory), or run where there is more memory")
