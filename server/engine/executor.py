"""The ranks of a tensor x pipeline parallel model as Ray actors, driven by the engine process.

One placement group holds them: STRICT_PACK for a tensor-parallel group (its all-reduces stay on
one node), SPREAD when there are pipeline stages (stages go to different nodes where there are
several). Each step's inputs go to every rank in one call each (Ray inlines such small values in
the call): one broadcast per step, no per-layer round trips through Ray. Steps queue on each
actor in order, so with pipeline stages several micro-batches are in flight at once.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from server.engine.shard_worker import ShardWorker, StepInputs
from server.wire import WorkerInfo

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 120.0  # resources for the placement group: fail with a reason rather than hang
# what a worker process must see before it imports torch (the ISA cap), and the caches it shares
FORWARDED_ENV = ("ATTNSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "ATTNSERVE_CACHE_DIR",
                 "TORCHINDUCTOR_CACHE_DIR", "HF_HUB_OFFLINE", "ATTNSERVE_NATIVE")


def placement_strategy(pipeline_parallel_size: int) -> str:
    """One tensor-parallel group on one node; pipeline stages spread over nodes where there are several."""
    return "STRICT_PACK" if pipeline_parallel_size == 1 else "SPREAD"


def worker_bundles(config) -> list[dict[str, float]]:
    """One bundle per rank, in rank order (bundle i holds rank i)."""
    return [{"CPU": config.worker_cpus} for _ in range(config.world_size)]


class WorkerDiedError(RuntimeError):
    """A rank is gone: the group cannot step again (the engine process exits; Serve restarts the replica)."""


@dataclass(frozen=True)
class PendingStep:
    """A step in flight: every rank's result reference; the logits come from `logits_rank`."""

    refs: tuple[Any, ...]
    logits_rank: int


class RayExecutor:
    def __init__(self, config) -> None:
        import ray  # noqa: PLC0415 - Ray: only where a model is sharded
        from ray._raylet import PlacementGroupID  # noqa: PLC0415 - Ray: only where a model is sharded
        from ray.util.placement_group import PlacementGroup, placement_group  # noqa: PLC0415 - Ray: only where a model is sharded
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415 - Ray: only where a model is sharded

        if not ray.is_initialized():
            # the engine process of a Serve replica joins the replica's cluster (core_client passes its
            # address); offline (attnserve generate) a local Ray starts
            address = os.environ.get("RAY_ADDRESS")
            local = {} if address else {"include_dashboard": False}
            ray.init(address=address or "local", log_to_driver=False, logging_level=logging.WARNING, **local)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world_size, self.pipeline_parallel_size = tp * pp, pp
        self.strategy = placement_strategy(pp)
        reserved = os.environ.get("ATTNSERVE_PLACEMENT_GROUP")
        # NOTE: a Serve replica's group was reserved with the replica (server/deployment.py): Serve owns it
        self.owns_group = reserved is None
        self.pg = placement_group(worker_bundles(config), strategy=self.strategy) if reserved is None else \
            PlacementGroup(PlacementGroupID(bytes.fromhex(reserved)))
        ready, _ = ray.wait([self.pg.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            self.shutdown()
            raise RuntimeError(f"no room for {self.world_size} workers of {config.worker_cpus} CPU each "
                               f"({self.strategy}) after {READY_TIMEOUT_S:.0f} s: the cluster has "
                               f"{ray.available_resources().get('CPU', 0)} CPUs free")
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        actor = ray.remote(ShardWorker)
        self.workers = [
            actor.options(num_cpus=config.worker_cpus, max_concurrency=1, runtime_env={"env_vars": env},
                          scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank))
            .remote(config, rank)
            for rank in range(self.world_size)]
        master = ray.get(self.workers[0].master_address.remote())
        ray.get([w.setup.remote(master) for w in self.workers])
        self.info: tuple[WorkerInfo, ...] = tuple(ray.get([w.describe.remote() for w in self.workers]))
        self.logits_rank = (pp - 1) * tp
        self.cpu_path = ray.get(self.workers[0].cpu_path.remote())

    def init_cache(self, num_blocks: int) -> str:
        """Every rank's pool, and its compiled step (warmed up by all ranks at once): the step kind."""
        steps = {step for step, _ in self._get([w.init_cache.remote(num_blocks) for w in self.workers])}
        return steps.pop() if len(steps) == 1 else "mixed"

    def submit(self, inputs: StepInputs) -> PendingStep:
        # a step's inputs are small (ids, positions, block tables): Ray inlines them in each call,
        # measured ~1 ms a step cheaper here than one ray.put and references
        return PendingStep(tuple(w.execute.remote(inputs) for w in self.workers), self.logits_rank)

    def result(self, step: PendingStep):
        """(R, V) logits (None when no row samples); raises WorkerDiedError when a rank died."""
        return self._get(list(step.refs))[step.logits_rank]

    def _get(self, refs: list) -> list:
        """Every rank's result; the first failure raises at once (NOTE: a rank that failed mid-step may
        leave the others waiting in a collective: the group cannot step again, whatever the error)."""
        import ray  # noqa: PLC0415 - Ray: only where a model is sharded

        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"a tensor/pipeline parallel worker died: {str(e).splitlines()[0]}") from None
        except ray.exceptions.RayTaskError as e:
            raise WorkerDiedError(f"a tensor/pipeline parallel worker failed: {str(e).splitlines()[0]}") from None

    def memory(self) -> list[dict[str, int]]:
        """Per rank: resident and peak resident bytes, its weights' and its KV pool's."""
        return self._get([w.memory.remote() for w in self.workers])

    def comm_stats(self) -> list[dict]:
        """Per rank: running totals of its steps and of their communication (ShardWorker.comm_stats)."""
        return self._get([w.comm_stats.remote() for w in self.workers])

    def shutdown(self) -> None:
        import ray  # noqa: PLC0415 - Ray: only where a model is sharded

        for w in getattr(self, "workers", ()):
            ray.kill(w)
        if self.owns_group:
            ray.util.remove_placement_group(self.pg)
