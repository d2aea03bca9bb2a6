"""Every value that crosses a process boundary: engine process <-> model replica <-> ingress.

Plain frozen dataclasses (pickled over a local pipe, or by Ray between replicas), and no
torch, so the API layer that uses them stays light.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from models.lora_format import LoraShapes
from models.native.cpu_path import CpuPath
from server.engine.pooling import Pooling
from server.engine.sampling_params import SamplingParams


# ---- LoRA adapters -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter as requests name it: checked once (models/lora_format.py) when registered."""

    name: str  # what a request's `model` says
    parent: str  # the served model it adapts
    path: str  # its directory (adapter_config.json + adapter_model.safetensors) on the replicas' file system
    salt: bytes  # models.lora_format.cache_salt of its digest: its KV blocks never match another's


@dataclass(frozen=True)
class LoadLora:
    """Make an adapter resident on the engine (loaded into a slot, evicting the least recently used)."""

    request_id: str
    ref: LoraRef


@dataclass(frozen=True)
class UnloadLora:
    """Drop an adapter: requests in flight on it finish first; new ones are refused."""

    request_id: str
    name: str


@dataclass(frozen=True)
class LoraAnswer:
    """The engine's answer to LoadLora / UnloadLora."""

    request_id: str
    error: str | None = None
    status: int = 200  # the HTTP status an error answers with
    seconds: float = 0.0  # a load's time: reading, checking and installing the weights


# ---- engine outputs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) alternatives, best first
    rank: int | None = None  # a prompt token's: 1 + the tokens more likely than it (vLLM's); None for sampled ones


@dataclass
class RequestStats:
    """One sequence's accounting, filled in by the engine; final once its request finished.
    Times are time.monotonic() seconds (one clock for every process on the host)."""

    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    peak_blocks: int = 0
    peak_kv_bytes: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    structured: str | None = None  # constrained decoding: json, json_object, regex, choice, grammar, tool_call
    grammar_wait_s: float | None = None  # arrival -> grammar compiled (or found in the cache)
    grammar_cache_hit: bool = False
    spec_drafted: list[int] = field(default_factory=list)  # speculative decoding: drafts offered at position i
    spec_accepted: list[int] = field(default_factory=list)  # ... and accepted at position i
    n: int = 1  # the request's samples (this is one of them) and its max_tokens: vLLM's request_params_*
    max_tokens: int = 0
    lora: str | None = None  # the LoRA adapter it ran with; None: the base model

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.spec_drafted)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.spec_accepted)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """First token to last token."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        """First scheduling to last token."""
        if self.last_token_time is None or self.first_scheduled_time is None:
            return None
        return self.last_token_time - self.first_scheduled_time

    @property
    def time_per_output_token(self) -> float | None:
        """The mean gap between output tokens after the first (0 with one token), as vLLM's
        request_time_per_output_token_seconds: the prefill's token does not count."""
        if self.decode_time is None:
            return None
        return self.decode_time / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sequence; the text and tokens are deltas."""

    request_id: str  # the caller's id; samples of an n > 1 request share it
    index: int  # which of the n samples
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    new_logprobs: tuple[TokenLogprob, ...] = ()
    stats: RequestStats | None = None  # set on the final output
    error: str | None = None
    stop_reason: str | None = None  # the stop string that ended it (finish_reason "stop"), as vLLM reports it
    # prompt_logprobs: per prompt token after the first, on the sample's first output
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    embedding: Any = None  # an embedding request's final output: its pooled vector, (hidden,) float32 numpy


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after one loop, as a value: metrics read this, never the engine."""

    time: float  # time.time() when taken
    num_running: int
    num_waiting: int
    num_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_unfinished_groups: int
    num_prompt_tokens: int  # counters from here on: cumulative since the engine started
    num_generated_tokens: int
    num_prefix_queries: int
    num_prefix_hits: int
    num_preemptions: int
    num_steps: int
    num_step_errors: int
    num_adds_received: int
    resident_memory_bytes: int  # the engine process's own
    preemptions_by_priority: dict[int, int] = field(default_factory=dict)  # the preempted request's priority -> count
    num_lora_loads: int = 0  # LoRA adapters installed into a slot, and evicted from one, since start
    num_lora_evictions: int = 0  # NOTE: for room or on unload: every adapter gone from a slot
    lora_load_seconds: float = 0.0  # the loads' time (reading, checking, installing), in total
    resident_loras: tuple[str, ...] = ()  # adapters in a slot now, least recently used first
    running_loras: tuple[str, ...] = ()  # adapters of running requests, and of waiting ones (vLLM's lora_requests_info)
    waiting_loras: tuple[str, ...] = ()

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool's blocks in use (what routing and autoscaling weigh)."""
        return self.num_used_blocks / max(1, self.num_blocks)


@dataclass(frozen=True)
class WorkerInfo:
    """One rank of a tensor x pipeline parallel engine (server/engine/shard_worker.py), as the
    dashboard and /v1/models show it."""

    rank: int
    tp_rank: int
    pp_rank: int
    node_id: str  # Ray's (two nodes on one machine share an IP)
    node_ip: str
    pid: int
    layers: tuple[int, int]  # [start, stop) of the model's layers
    num_heads: int  # query heads this rank computes
    num_kv_heads: int  # K/V heads it stores
    weight_bytes: int
    kv_bytes_per_block: int  # its share of one block id
    num_threads: int
    collectives: str  # how its stage's ranks all-reduce: shm (one node), gloo, nccl; none without tensor parallelism


@dataclass(frozen=True)
class ModelInfo:
    """What the replica and the API layer need to know of a served model (/v1/models, admission)."""

    max_model_len: int
    attention: str  # mha | gqa | mqa
    num_kv_heads: int
    kv_bytes_per_token: int
    vocab_size: int
    block_size: int
    num_blocks: int
    num_heads: int  # query heads: with num_kv_heads, what MHA / GQA / MQA forms would cost
    kv_cache_dtype: str  # the pool's storage: bfloat16, float32, fp8_e4m3 or fp8_e5m2
    cpu_path: CpuPath  # how the engine computes on its machine (ISA, dtype, linears, attention kernel)
    quantization: str  # the weights as served: none, int8, int4_g32, int4_g128, or a GGUF's types (Q4_1+Q8_0)
    weight_bytes: int  # bytes the weights take as served (with kv_cache_memory auto: memory_budget - this = KV pool)
    speculative: str | None = None  # speculative decoding's method (ngram, draft_model), None when off
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None = global; () = all global
    kv_block_bytes: int = 0  # bytes of one pool block (one KV group's layers): kv_bytes_per_token x block_size without windows
    attention_variants: tuple[str, ...] = ()  # ModelConfig.attention_variants: sliding_window, qk_norm, ...
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    workers: tuple[WorkerInfo, ...] = ()  # the ranks, when the model is sharded over several
    reasoning_parser: str | None = None  # server/reasoning.py: deepseek_r1 or qwen3 (auto resolved); None: off
    scheduling_policy: str = "fcfs"  # fcfs, or priority: requests' `priority` orders admission and preemption
    task: str = "generate"  # what the model serves: generate, or embed (/v1/embeddings; then `pooling` says how)
    pooling: Pooling | None = None
    hidden_size: int = 0  # an embedding's width (`dimensions` may truncate it)
    lora: LoraShapes | None = None  # what LoRA adapters must fit; None: the engine has no LoRA slots (max_loras 0)


# ---- replica -> metrics hub ----------------------------------------------------------------------
@dataclass(frozen=True)
class HistogramCounts:
    """One histogram's counts per label value (server/metrics.py HISTOGRAMS)."""

    buckets: tuple[float, ...]
    series: dict[str, list[float]]  # label value -> [count per bucket..., +Inf count, sum]


@dataclass(frozen=True)
class ReplicaGauges:
    """A replica's current values (summed over the live replicas when rendered)."""

    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int
    kv_bytes_total: int
    kv_bytes_used: int
    requests_running: int
    requests_waiting: int
    resident_memory_bytes: int  # the replica's and its engine process's


@dataclass(frozen=True)
class RequestPoint:
    """One finished request, for the dashboard's scatter plots."""

    seq_len: int
    prompt_tokens: int
    output_tokens: int
    kv_bytes: int
    ttft: float | None
    itl: float | None  # mean gap between its output tokens
    e2e: float | None


@dataclass(frozen=True)
class MetricsSnapshot:
    """One replica's cumulative counts and current gauges, pushed to the metrics hub about once a second
    and merged per model (server/prometheus.py, server/dashboard.py). Fields added later carry defaults:
    a snapshot pickled by an older replica reads them as their default."""

    model: str
    info: ModelInfo  # the served model's facts: labels, pool geometry, weights
    time: float  # time.time() when taken: a replica silent for long is gone
    counters: dict[str, int]  # server/metrics.py COUNTERS
    gauges: ReplicaGauges
    histograms: dict[str, HistogramCounts]  # server/metrics.py HISTOGRAMS
    finish_reasons: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    structured: dict[str, int] = field(default_factory=dict)  # constrained requests by kind
    preemptions_by_priority: dict[str, int] = field(default_factory=dict)  # the preempted request's priority -> count
    spec_drafted: tuple[int, ...] = ()  # speculative decoding: drafts at position i, summed over requests
    spec_accepted: tuple[int, ...] = ()
    recent: tuple[RequestPoint, ...] = ()
    lora_requests: dict[str, int] = field(default_factory=dict)  # finished requests by LoRA adapter
    lora_prompt_tokens: dict[str, int] = field(default_factory=dict)
    lora_generation_tokens: dict[str, int] = field(default_factory=dict)
    loras: tuple[str, ...] = ()  # the adapters resident on the replica now
    running_loras: tuple[str, ...] = ()  # adapters of its running requests, and of its waiting ones (EngineStats)
    waiting_loras: tuple[str, ...] = ()
    replica: str = "?"  # Ray's replica and node ids, set by the reporter
    node: str = "local"

    @property
    def labels(self) -> tuple[str, str, str, str]:
        """(model, attention, kv_heads, kv_cache_dtype): server/metrics.py MODEL_LABELS."""
        return self.model, self.info.attention, str(self.info.num_kv_heads), self.info.kv_cache_dtype


# ---- replica <-> engine process ------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float
    final_only: bool = False  # a non-streaming caller: one output per sample, when it finishes
    embed: bool = False  # an embedding request: prefill only, one final output with its pooled vector
    lora: LoraRef | None = None  # the adapter it runs with; None: the base model


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class InjectStepFailures:
    """Chaos testing: the next `count` model steps raise."""

    count: int


@dataclass(frozen=True)
class SlowSteps:
    """Chaos testing: sleep this long before every step (0 turns it off)."""

    delay_s: float


@dataclass(frozen=True)
class EngineReady:
    info: ModelInfo
    pid: int
    stats: EngineStats  # so the replica never lacks one


@dataclass(frozen=True)
class StepOutputs:
    """One engine loop's outputs (possibly none: an abort only changed the stats)."""

    outputs: tuple[RequestOutput, ...]
    stats: EngineStats


@dataclass(frozen=True)
class ComputeAttention:
    """Replica -> engine: attention weights of one prompt (the written-out formula, eager)."""

    request_id: str
    token_ids: tuple[int, ...]
    layers: tuple[int, ...] | None


@dataclass(frozen=True)
class AttentionWeights:
    """Engine -> replica: per layer (index, float32 array heads x T x T), or why not. `windows`:
    per entry of `layers`, its sliding window (None: global); `sinks`: the model's layers have
    learned sinks (a row then sums to 1 minus the sink's share)."""

    request_id: str
    layers: tuple[tuple[int, Any], ...] = ()
    error: str | None = None
    windows: tuple[int | None, ...] = ()  # () from an older engine: every layer global
    sinks: bool = False


@dataclass(frozen=True)
class CachedBlocks:
    """A bounded summary of the prefix cache (`router.summary_key` of each cached block's hash,
    the newest first kept), sent about once a second while the engine works: replicas report
    it to the router."""

    keys: frozenset[bytes]


# ---- ingress <-> model replica -------------------------------------------------------------------
@dataclass(frozen=True)
class LogprobEntry:
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...]


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token as echo's logprobs and vLLM's prompt_logprobs show it: the first token has no
    logprob, rank or alternatives (None); `top` is (token id, text, logprob), best first."""

    token_id: int
    token: str
    logprob: float | None
    rank: int | None
    top: tuple[tuple[int, str, float], ...] | None


@dataclass(frozen=True)
class GenerateCall:
    """One prompt (text, token ids, or chat messages) and how to sample it."""

    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    fit_max_tokens: bool = False  # max_tokens not given: use what the context leaves (capped by params)
    stream: bool = True  # False: one chunk per sample, when it finishes
    block_hashes: tuple[bytes, ...] = ()  # the prompt's full blocks' prefix-cache hashes (cache-aware routing)
    tools: tuple[dict, ...] | None = None  # OpenAI tool definitions for the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat-template arguments ({"enable_thinking": False})
    chat: bool = False  # a chat's answer (kept when the ingress tokenizes its messages): reasoning applies
    echo: bool = False  # completions' echo: the prompt's text comes back in PromptInfo
    lora: LoraRef | None = None  # the adapter the request named in `model`; None: the base model


@dataclass(frozen=True)
class EmbedCall:
    """The inputs of one `POST /v1/embeddings`: each a text (tokenized with the model's special tokens, as
    sentence-transformers does) or token ids."""

    inputs: tuple[str | tuple[int, ...], ...]
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class Embeddings:
    """Per input, in order, its embedding at the model's full width ((hidden,) float32 numpy, normalised
    where the model's pooling says), and the tokens the inputs took."""

    vectors: tuple[Any, ...]
    num_prompt_tokens: int


@dataclass(frozen=True)
class AttentionCall:
    """One prompt whose attention weights to compute (`POST /v1/attention`)."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    layers: tuple[int, ...] | None = None  # None: every layer
    max_tokens: int = 512  # a longer prompt is refused (the weights grow with its square)


@dataclass(frozen=True)
class AttentionMap:
    """Per chosen layer, heads x query x key weights (nested lists), and the prompt's tokens;
    per chosen layer its sliding window (None: global), and whether the layers have sinks."""

    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]
    layers: tuple[tuple[int, list], ...]
    windows: tuple[int | None, ...] = ()  # () from an older replica: every layer global
    sinks: bool = False


@dataclass(frozen=True)
class PromptInfo:
    """First item of every generation stream."""

    num_prompt_tokens: int
    reasoning: str | None = None  # a reasoning model's chat: where its answer starts (server/reasoning.py STARTS)
    prompt_text: str | None = None  # with echo: the prompt's token ids as text


@dataclass(frozen=True)
class Chunk:
    """Text and tokens one step added to one sample; final chunks carry the accounting."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...] = ()
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    peak_kv_bytes: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts the sample's steps verified
    num_accepted_tokens: int = 0  # ... and accepted
    error: str | None = None
    stop_reason: str | None = None  # the stop string that ended the sample
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # every prompt token, on the sample's first chunk
