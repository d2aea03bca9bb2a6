"""Cache-aware request routing between a model's replicas (Ray Serve's RequestRouter API).

The ingress tokenizes a prompt once and hashes its full blocks with the prefix cache's own
chained hash (`GenerateCall.block_hashes`). Every replica reports, about once a second
(`record_routing_stats`), a bounded summary of the block hashes its prefix cache holds. A
request goes to the replica holding the longest run of its blocks, and a prompt that no replica
holds to the one with the fewest cached blocks; when the chosen replica is too much busier than
the least loaded one, or its KV pool is full with requests waiting, the choice falls back to
power of two choices (Serve probes both and takes the shorter queue).

A request for a LoRA adapter (Serve's multiplexed model id) first narrows the choice as Serve's
MultiplexMixin does: to the calm replicas that hold the adapter, else to the calm ones holding the
fewest adapters (where loading it evicts least); the cache rule then picks among those.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from kvcache.block_pool import summary_key

KV_FULL = 0.95  # above this KV usage, with requests waiting, a replica takes no affinity traffic
DEFAULT_IMBALANCE = 8  # ongoing requests more than the least loaded replica's: fall back
ROUTED_TTL_S = 5.0  # a prompt's blocks count as cached where it was sent, until summaries show them
MAX_ROUTED_KEYS = 16384  # per replica


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica when it routes a request."""

    replica_id: Hashable
    num_ongoing: int  # requests sent and not finished (the router's live count, else the replica's)
    num_waiting: int = 0
    kv_usage: float = 0.0
    cached: frozenset[bytes] = frozenset()  # summary keys of the blocks its prefix cache holds
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it holds (Serve's multiplexed model ids)


def num_cached_blocks(block_hashes: Sequence[bytes], cached: frozenset[bytes]) -> int:
    """How many of the prompt's blocks, from the first, the replica holds: what a prefix hit reuses."""
    n = 0
    for h in block_hashes:
        if summary_key(h) not in cached:
            break
        n += 1
    return n


def with_adapter(loads: Sequence[ReplicaLoad], adapter: str, least: int, imbalance: int) -> list[ReplicaLoad]:
    """Serve's multiplex rule among the calm replicas: those holding `adapter`, else those holding
    the fewest adapters."""
    calm = [r for r in loads if r.num_ongoing - least <= imbalance]
    holding = [r for r in calm if adapter in r.adapters]
    if holding:
        return holding
    fewest = min(len(r.adapters) for r in calm)
    return [r for r in calm if len(r.adapters) == fewest]


def pick_replica(loads: Sequence[ReplicaLoad], block_hashes: Sequence[bytes],
                 imbalance: int = DEFAULT_IMBALANCE, adapter: str | None = None) -> Hashable | None:
    """The replica with the longest cached run of the prompt's blocks (ties: the less loaded). A
    prompt no replica holds goes where the fewest blocks are cached, so new prefixes spread out.
    With an `adapter`, only among the replicas `with_adapter` keeps (without block hashes: the least
    loaded of them). None (pow2 decides) without block hashes or adapter, or when load says not to
    follow the cache."""
    if not loads or (not block_hashes and adapter is None):
        return None
    least = min(r.num_ongoing for r in loads)
    if adapter is not None:
        loads = with_adapter(loads, adapter, least, imbalance)
        if not block_hashes:
            return min(loads, key=lambda r: r.num_ongoing).replica_id
    best = max(loads, key=lambda r: (num_cached_blocks(block_hashes, r.cached), -r.num_ongoing))
    if num_cached_blocks(block_hashes, best.cached) == 0:
        calm = [r for r in loads if r.num_ongoing - least <= imbalance]
        return min(calm, key=lambda r: (len(r.cached), r.num_ongoing)).replica_id
    # NOTE: affinity never outweighs load: a busy or full replica hands the request to pow2
    if best.num_ongoing - least > imbalance:
        return None
    if best.kv_usage >= KV_FULL and best.num_waiting > 0:
        return None
    return best.replica_id


def with_routed(cached: frozenset[bytes], routed: dict[bytes, float], now: float,
                ttl: float = ROUTED_TTL_S) -> frozenset[bytes]:
    """A replica's reported summary plus the blocks of prompts sent to it in the last `ttl` seconds:
    the summary lags by a second or two, and a burst of one new prefix must not scatter meanwhile."""
    recent = {k for k, t in routed.items() if now - t < ttl}
    return cached | recent if recent else cached


def routing_stats(num_running: int, num_waiting: int, kv_usage: float, cached: frozenset[bytes]) -> dict[str, Any]:
    """What a replica's `record_routing_stats` returns."""
    return {"num_running": num_running, "num_waiting": num_waiting, "kv_usage": kv_usage, "cached": cached}


class CacheAwareRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Prefix-cache affinity on what each replica actually caches, after LoRA adapter affinity (Serve's
    multiplexing: `RequestRouter.update_replicas` keeps the mixin's model ids); power of two choices
    otherwise."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs) -> None:
        """Serve calls this once, right after constructing the router."""
        self.imbalance = imbalance
        self._routed: dict[Any, dict[bytes, float]] = {}  # replica -> summary key -> when last sent there
        self._routed_adapters: dict[Any, dict[str, float]] = {}  # replica -> adapter -> when last sent there

    def _load(self, replica: RunningReplica, now: float) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        live = self.replica_queue_len_cache.get(replica.replica_id)
        ongoing = live if live is not None else stats.get("num_running", 0) + stats.get("num_waiting", 0)
        cached = with_routed(stats.get("cached", frozenset()), self._routed.get(replica.replica_id, {}), now)
        # NOTE: a replica's model ids reach the router a moment after it loads: one just sent an adapter holds it
        recent = self._routed_adapters.get(replica.replica_id, {})
        adapters = frozenset(replica.multiplexed_model_ids) | {a for a, t in recent.items() if now - t < ROUTED_TTL_S}
        return ReplicaLoad(replica.replica_id, ongoing, stats.get("num_waiting", 0), stats.get("kv_usage", 0.0),
                           cached, adapters)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        now = time.monotonic()
        adapter = _adapter(pending_request)
        if adapter is not None:
            self._routed_adapters.setdefault(replica_id, {})[adapter] = now
        hashes = _block_hashes(pending_request)
        if not hashes:
            return
        keys = self._routed.setdefault(replica_id, {})
        if len(keys) > MAX_ROUTED_KEYS:
            for k in [k for k, t in keys.items() if now - t >= ROUTED_TTL_S]:
                del keys[k]
        for h in hashes:
            keys[summary_key(h)] = now

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._routed.pop(replica_id, None)
        self._routed_adapters.pop(replica_id, None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hashes, adapter = _block_hashes(pending_request), _adapter(pending_request)
        if (hashes or adapter is not None) and len(candidate_replicas) > 1:
            now = time.monotonic()
            chosen = pick_replica([self._load(r, now) for r in candidate_replicas], hashes, self.imbalance, adapter)
            if chosen is not None:
                return [[r for r in candidate_replicas if r.replica_id == chosen]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


def _block_hashes(pending: PendingRequest | None) -> tuple[bytes, ...]:
    """The block hashes a `generate` call carries (other calls carry none)."""
    if pending is None or not pending.args:
        return ()
    return tuple(getattr(pending.args[0], "block_hashes", ()) or ())


def _adapter(pending: PendingRequest | None) -> str | None:
    """The LoRA adapter a request names (its multiplexed model id), or None."""
    return (pending.metadata.multiplexed_model_id or None) if pending is not None else None
