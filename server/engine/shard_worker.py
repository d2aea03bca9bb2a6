"""One rank of a tensor x pipeline parallel group, run as a Ray actor (`server/engine/executor.py`).

It holds its shard of the model (models/parallel.py) and of the paged KV pool (its K/V heads, its
stage's layers), and runs every step it is sent: the same block tables on every rank, collectives
between the ranks of a stage, hidden states from stage to stage. The engine's scheduler and
sampler stay in the engine process; only the last stage's first rank returns logits.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvcache.paged_attention import AttentionMetadata, PagedAttention, warm_up_steps
from kvcache.storage import KVCacheSpec, PagedKVCache
from models.loader import load_for_serving
from models.native.memory import resident_bytes
from models.parallel import Shard, TensorParallelGroup, parallelize
from models.registry import resolve_model
from models.shm_comm import ShmCommunicator
from server.engine.step import choose_step
from server.wire import WorkerInfo

logger = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 120


@dataclass(frozen=True)
class StepInputs:
    """What every rank needs of one step: sent once per step to all of them."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (R,)


class ShardWorker:
    """Loads its shard at construction; `init_cache` sizes its pool and compiles; `execute` runs steps."""

    def __init__(self, config, rank: int) -> None:

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
        self.config = config
        self.shard = Shard.of_rank(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
        self.num_threads = config.worker_threads
        torch.set_num_threads(self.num_threads)

    def master_address(self) -> str:
        """Rank 0's address for torch.distributed's rendezvous: this node, a free port."""

        import ray  # noqa: PLC0415 - Ray: only in a shard's worker

        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    def setup(self, master: str) -> None:
        """Join the group, then load this rank's shard (tensor by tensor) and join it with collectives."""

        config, shard = self.config, self.shard
        tp, pp = shard.tp_size, shard.pp_size
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        # NOTE: a rank waiting on a dead peer gives up after the timeout instead of hanging for good
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=shard.rank, world_size=tp * pp,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # NOTE: every rank creates every stage's group, in the same order (new_group is collective)
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        self.model = load_for_serving(resolve_model(config.model), config.dtype, config.device,
                                      config.quantization, shard, config.activations)
        self.weight_bytes = self.model.weight_bytes()
        group = groups[shard.pp_rank]
        self.shm = self._shared_memory(group) if tp > 1 else None
        self.collectives = "none" if tp == 1 else "shm" if self.shm is not None else backend
        parallelize(self.model, shard, TensorParallelGroup(group, tp, shard.tp_rank, shm=self.shm))
        self.layers = self.model.layer_range
        self.spec = KVCacheSpec.of(self.model.config, self.model.dtype, config.block_size)
        self.forward, self.cache, self.step = self.model, None, "eager"
        self.sends: deque = deque()  # isends in flight to the next stage (their tensors kept alive)
        self.num_steps, self.timers = 0, {"step": 0.0, "recv": 0.0, "send": 0.0}

    def _shared_memory(self, group):
        """A shared-memory communicator for this stage's ranks when they share a node (gloo otherwise).

        NOTE: every rank of the group decides alike (from all their node ids), since setting one up is
        a collective. Its slots fit the largest collective of a step: the all-reduce of every token's
        hidden state, or the LM head's all-gather of every sampling row's logits."""
        import ray  # noqa: PLC0415 - Ray: only in a shard's worker

        nodes = [None] * self.shard.tp_size
        dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id(), group=group)
        if len(set(nodes)) > 1 or self.config.device != "cpu":
            return None
        cfg, config = self.model.config, self.config
        width = torch.finfo(self.model.dtype).bits // 8
        rows = min(config.max_num_batched_tokens, config.max_num_seqs * (1 + self._max_drafts()))
        largest = max(config.max_num_batched_tokens * cfg.hidden_size, rows * -(-cfg.vocab_size // self.shard.tp_size))
        return ShmCommunicator.over_group(group, largest * width)

    def _max_drafts(self) -> int:
        spec = self.config.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    def describe(self) -> WorkerInfo:
        import ray  # noqa: PLC0415 - Ray: only in a shard's worker

        cfg = self.model.config
        return WorkerInfo(self.shard.rank, self.shard.tp_rank, self.shard.pp_rank,
                          ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid(), (self.layers.start, self.layers.stop),
                          cfg.num_heads, cfg.num_kv_heads, self.weight_bytes, self.kv_bytes_per_block(), self.num_threads,
                          self.collectives)

    def kv_bytes_per_block(self) -> int:
        slots = {self.spec.layer_group[i][1] for i in self.layers}
        return len(slots) * self.spec.bytes_per_layer_token * self.spec.block_size

    def cpu_path(self):
        return self.model.cpu_path

    def init_cache(self, num_blocks: int) -> tuple[str, float]:
        """The pool, then the compiled step (warmed up by all ranks together): (step kind, seconds)."""

        self.cache = PagedKVCache(self.spec, num_blocks, self.model.device, layers=self.layers)
        # native: a whole model's rank whose all-reduces go through shared memory
        step = choose_step(self.model, self.cache, not self.config.enforce_eager, self.config.native_decoder,
                           self._warm_up, f"rank {self.shard.rank}")
        self.forward, self.step = step.forward, step.kind
        return self.step, step.seconds

    def _warm_up(self, forward) -> None:
        """The steps ModelRunner runs to warm up, through this rank's execute (all ranks at once)."""
        self.forward = forward
        for ids, positions, meta in warm_up_steps(self.spec, self.model.device):
            self.execute(StepInputs(ids, positions, meta, torch.tensor([len(ids) - 1])))

    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        start = time.perf_counter()
        try:
            return self._execute(inputs)
        finally:
            self.timers["step"] += time.perf_counter() - start

    @torch.inference_mode()
    def _execute(self, inputs: StepInputs) -> torch.Tensor | None:
        """One step on this rank: logits (R, V) from the last stage's first rank, None elsewhere."""

        shard, tp = self.shard, self.shard.tp_size
        self.num_steps += 1
        hidden = None
        if shard.pp_rank > 0:
            hidden = torch.empty(inputs.input_ids.shape[0], self.model.config.hidden_size, dtype=self.model.dtype)
            start = time.perf_counter()
            dist.recv(hidden, src=shard.rank - tp)
            self.timers["recv"] += time.perf_counter() - start
        stage_input = {} if hidden is None else {"hidden": hidden}  # the native decoder takes none
        out = self.forward(inputs.input_ids, inputs.positions, PagedAttention(self.cache, inputs.attn),
                           **stage_input)  # (T, C)
        if shard.pp_rank < shard.pp_size - 1:
            # sent without waiting: this stage goes on with the next micro-batch while the next stage runs
            start = time.perf_counter()
            while len(self.sends) >= shard.pp_size:
                self.sends.popleft()[0].wait()
            out = out.contiguous()
            self.sends.append((dist.isend(out, dst=shard.rank + tp), out))
            self.timers["send"] += time.perf_counter() - start
            return None
        if not len(inputs.logits_indices):
            return None
        logits = self.model.logits(out[inputs.logits_indices])  # (R, V) in the model's dtype: every TP rank gathers
        return logits if shard.tp_rank == 0 else None

    def memory(self) -> dict[str, int]:
        """This process's resident and peak resident bytes (VmRSS, VmHWM)."""
        rss, peak_rss = resident_bytes()
        return {"rss": rss, "peak_rss": peak_rss,
                "weight_bytes": self.weight_bytes, "kv_bytes": self.cache.nbytes if self.cache is not None else 0}

    def comm_stats(self) -> dict:
        """Running totals (benchmarks take differences): steps, seconds in them, and seconds in
        communication: shared-memory collectives (copies, waiting for the stage's other ranks, sums),
        waiting for the previous stage's hidden states, and for sends to the next stage."""
        calls, shm_s = self.shm.stats() if self.shm is not None else (0, 0.0)
        return {"rank": self.shard.rank, "steps": self.num_steps, "step_s": self.timers["step"],
                "collectives": calls, "collective_s": shm_s, "recv_s": self.timers["recv"], "send_s": self.timers["send"]}
