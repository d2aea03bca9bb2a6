"""What one attnserve Serve application runs: models, engine settings, replica resources, limits."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from server.engine.config import EngineConfig
from server.openai_api import ApiLimits

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ServeConfig:
    models: dict[str, str] = field(default_factory=lambda: {"default": "default"})  # served name -> path or name
    dtype: str = "bfloat16"
    block_size: int = 16
    kv_cache_memory: str | int | None = "1GiB"
    num_blocks: int | None = None
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_waiting: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no torch.compile of the model step
    num_replicas: int = 1
    model_replicas: dict[str, int] | None = None  # per-model override of num_replicas
    autoscaling: dict[str, Any] | None = None  # Serve autoscaling_config, e.g. {"min_replicas": 1, "max_replicas": 4}
    max_ongoing_requests: int = 256  # Serve's default of 5 would cap continuous batching
    num_cpus: float | None = None  # per model replica; None = share the cluster's CPUs evenly
    num_gpus: float = 0.0  # per model replica; > 0 runs the engine on CUDA
    threads: int | None = None  # torch threads per replica; None = round(num_cpus)
    api_key: str | None = None
    graceful_shutdown_timeout_s: float = 20.0  # on shutdown, in-flight requests get this long to finish
    limits: ApiLimits = field(default_factory=ApiLimits)  # serve.yaml: a mapping of ApiLimits fields

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
        if self.autoscaling is not None and not {"min_replicas", "max_replicas"} <= set(self.autoscaling):
            raise ValueError("autoscaling needs min_replicas and max_replicas")
        self.engine_config("default")  # validates the engine fields now
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
        return cls(**args)

    def engine_config(self, model: str, threads: int | None = None) -> EngineConfig:
        return EngineConfig(
            model=model, dtype=self.dtype, block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
            num_blocks=self.num_blocks, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, max_waiting=self.max_waiting,
            num_threads=threads, enable_prefix_caching=self.enable_prefix_caching,
            enforce_eager=self.enforce_eager, device="cuda" if self.num_gpus > 0 else "cpu",
        )

    def replicas(self, model: str) -> int:
        """Replicas a model starts with."""
        if self.autoscaling:
            return int(self.autoscaling.get("initial_replicas", self.autoscaling["min_replicas"]))
        return (self.model_replicas or {}).get(model, self.num_replicas)

    @property
    def total_replicas(self) -> int:
        return sum(self.replicas(m) for m in self.models)

    def replica_cpus(self, cluster_cpus: float | None) -> float:
        """CPUs per model replica: as configured, or an even share that lets every replica start."""
        if self.num_cpus is not None:
            return self.num_cpus
        if not cluster_cpus:
            return 1.0
        share = cluster_cpus / self.total_replicas
        return max(0.05, min(share, 4.0) // 0.05 * 0.05)
