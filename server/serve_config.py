"""What one attnserve Serve application runs: models, engine settings, replica resources, limits."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from server.engine.config import EngineConfig
from server.openai_api import ApiLimits
from server.response_store import StoreConfig

ROUTERS = ("cache", "pow2")
DEFAULT_MAX_LORAS = 4  # slots per replica when adapters are served and engine.max_loras is not set
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ServeConfig:
    models: dict[str, str] = field(default_factory=lambda: {"default": "default"})  # served name -> path or name
    # every model's engine settings; `model` and `device` are set per model, and `num_threads`
    # (torch threads per replica) defaults to round(num_cpus)
    engine: EngineConfig = field(default_factory=EngineConfig)  # serve.yaml: a mapping of EngineConfig fields
    num_replicas: int = 1
    model_replicas: dict[str, int] | None = None  # per-model override of num_replicas
    autoscaling: dict[str, Any] | None = None  # Serve autoscaling_config, e.g. {"min_replicas": 1, "max_replicas": 4}
    max_ongoing_requests: int = 256  # Serve's default of 5 would cap continuous batching
    num_cpus: float | None = None  # per model replica; None = share the cluster's CPUs evenly
    num_gpus: float = 0.0  # per model replica; > 0 runs the engine on CUDA
    api_key: str | None = None
    graceful_shutdown_timeout_s: float = 20.0  # on shutdown, in-flight requests get this long to finish
    # one model: its replicas serve HTTP themselves (one Ray hop fewer per token); True keeps an
    # OpenAIIngress in front, which answers /health with 503 while every model replica is down
    separate_ingress: bool = False
    # how requests pick among a model's replicas: "cache" (the replica whose prefix cache holds the
    # longest run of the prompt's blocks; the ingress tokenizes) or "pow2" (Serve's default)
    router: str = "cache"
    # Ray custom resources: each model replica asks for `replica_resources` (e.g. one "replica_slot"
    # per node spreads them); the ingress and the metrics hub for `ingress_resources` (pin them to a
    # node that stays, e.g. the head)
    replica_resources: dict[str, float] = field(default_factory=dict)
    ingress_resources: dict[str, float] = field(default_factory=dict)
    limits: ApiLimits = field(default_factory=ApiLimits)  # serve.yaml: a mapping of ApiLimits fields
    # /v1/responses with `store`: the most responses kept for previous_response_id and GET (the oldest
    # goes first), and for how long; one store per application, every replica reads it
    responses_store_size: int = StoreConfig.max_responses
    responses_store_ttl_s: float = StoreConfig.ttl_s
    # LoRA adapters of the (one) served model: name -> directory (adapter_config.json +
    # adapter_model.safetensors) on the replicas; requests name one in `model`. Without engine.max_loras
    # the replicas get DEFAULT_MAX_LORAS slots
    lora_modules: dict[str, str] = field(default_factory=dict)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter without an API key (they read server paths)
    allow_runtime_lora: bool = False

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("serve at least one model")
        for name in self.models:
            if not _NAME.match(name):
                raise ValueError(f"invalid model name {name!r}: letters, digits, '.', '_' and '-' only")
        if self.num_replicas < 1 or any(n < 1 for n in (self.model_replicas or {}).values()):
            raise ValueError("num_replicas must be >= 1")
        if set(self.model_replicas or {}) - set(self.models):
            raise ValueError("model_replicas names a model that is not served")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        if self.num_cpus is not None and self.num_cpus <= 0:
            raise ValueError("num_cpus must be positive")
        for resources in (self.replica_resources, self.ingress_resources):
            if any(not isinstance(v, (int, float)) or v <= 0 for v in resources.values()):
                raise ValueError("custom resources must be positive amounts, e.g. {\"replica_slot\": 1}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}")
        if self.autoscaling is not None and not {"min_replicas", "max_replicas"} <= set(self.autoscaling):
            raise ValueError("autoscaling needs min_replicas and max_replicas")
        for name, path in self.lora_modules.items():
            if not _NAME.match(name) or name in self.models:
                raise ValueError(f"invalid LoRA adapter name {name!r}: letters, digits, '.', '_' and '-' only, and "
                                 "not a served model's name")
            if not isinstance(path, str) or not path:
                raise ValueError(f"LoRA adapter {name!r} needs a path")
        if self.lora_modules and len(self.models) > 1:
            raise ValueError("lora_modules adapt the one served model; with several, load adapters with "
                             "POST /v1/load_lora_adapter and its base_model")
        if self.lora_modules and not self.engine.max_loras:
            object.__setattr__(self, "engine", replace(self.engine, max_loras=DEFAULT_MAX_LORAS))
        self.engine_config("default")  # validates the engine fields now
        self.responses_store  # noqa: B018 - validates the store's size and TTL now
        if self.api_key is None and os.environ.get("ATTNSERVE_API_KEY"):
            object.__setattr__(self, "api_key", os.environ["ATTNSERVE_API_KEY"])

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServeConfig:
        args = dict(args or {})
        known = {f.name for f in fields(cls)}
        unknown = set(args) - known
        if unknown:
            raise ValueError(f"unknown serve arguments: {sorted(unknown)}; known: {sorted(known)}")
        if isinstance(args.get("limits"), dict):
            args["limits"] = ApiLimits(**args["limits"])
        if isinstance(args.get("engine"), dict):
            args["engine"] = EngineConfig(**args["engine"])
        return cls(**args)

    @property
    def responses_store(self) -> StoreConfig:
        return StoreConfig(self.responses_store_size, self.responses_store_ttl_s)

    def engine_config(self, model: str, cpus: float = 1.0) -> EngineConfig:
        """One model's engine on a replica of `cpus` CPUs; a sharded model's workers split them evenly."""
        device = "cuda" if self.num_gpus > 0 else "cpu"
        world = self.engine.world_size
        if world > 1:
            worker_cpus = max(0.05, int(cpus / world * 20 + 1e-9) / 20)  # whole twentieths of a CPU
            threads = self.engine.num_threads or max(1, round(worker_cpus))
            return replace(self.engine, model=model, num_threads=threads, worker_cpus=worker_cpus, device=device)
        threads = self.engine.num_threads or max(1, round(cpus))
        return replace(self.engine, model=model, num_threads=threads, device=device)

    def replicas(self, model: str) -> int:
        """Replicas a model starts with."""
        if self.autoscaling:
            return int(self.autoscaling.get("initial_replicas", self.autoscaling["min_replicas"]))
        return (self.model_replicas or {}).get(model, self.num_replicas)

    def most_replicas(self, model: str) -> int:
        """Replicas a model may grow to."""
        return int(self.autoscaling["max_replicas"]) if self.autoscaling else self.replicas(model)

    @property
    def serves_lora(self) -> bool:
        """The replicas have LoRA slots: requests may name adapters."""
        return self.engine.max_loras > 0

    def routes_by_cache(self, model: str) -> bool:
        """Cache-aware routing applies: the router is "cache" and the model may have several replicas."""
        return self.router == "cache" and self.most_replicas(model) > 1

    @property
    def total_replicas(self) -> int:
        return sum(self.replicas(m) for m in self.models)

    def replica_cpus(self, cluster_cpus: float | None) -> float:
        """CPUs per model replica: as configured, or an even share that lets every replica start."""
        if self.num_cpus is not None:
            return self.num_cpus
        if not cluster_cpus:
            return 1.0
        # NOTE: shared among as many replicas as autoscaling may start, so the last one still fits
        share = cluster_cpus / sum(self.most_replicas(m) for m in self.models)
        return max(0.05, int(min(share, 4.0) * 20 + 1e-9) / 20)  # whole twentieths of a CPU
