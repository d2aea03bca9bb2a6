"""Ray Serve: one `ModelDeployment` per served model (one engine per replica) behind an
`OpenAIIngress` that owns the FastAPI app and routes by the request's `model` field. An
application with one model (unless `separate_ingress`) is one `ModelServer` deployment instead:
its replicas serve HTTP themselves, unless it has several replicas routed by cache
(`server/router.py`): the ingress then tokenizes and hashes prompts so the router can place them.

What the replicas of an application share lives in one detached named actor per application and
cluster (`AppState`): the metrics hub, the LoRA adapter registry (server/lora_registry.py) and the
stored responses (server/response_store.py). A model replica holds adapters as Serve's multiplexed models (at most
max_loras, least recently used out), and a request for an adapter goes, through
`handle.options(multiplexed_model_id=...)`, to a replica that holds it where one does.

`build_app(args)` is the application builder for both `attnserve serve` and Ray's own
`serve run deploy/serve.yaml`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from kvcache.manager import prompt_block_hashes
from models.registry import resolve_model
from models.tokenizer import load_tokenizer
from server.autoscaling import autoscaling_config, autoscaling_stats
from server.engine.config import EngineConfig
from server.engine.executor import placement_strategy, worker_bundles
from server.http_app import create_app
from server.lora_registry import AdapterRegistry, RemoteAdapters
from server.model_client import LocalModelClient, ModelClient
from server.openai_api import ApiLimits, OpenAIApi
from server.response_store import ResponseStore, StoreClient, StoreConfig
from server.router import CacheAwareRouter, routing_stats
from server.serve_config import ServeConfig
from server.wire import (
    AttentionCall,
    AttentionMap,
    Chunk,
    EmbedCall,
    Embeddings,
    GenerateCall,
    LoraRef,
    MetricsSnapshot,
    ModelInfo,
    PromptInfo,
)
from server.worker import ModelWorker, encode_prompt

logger = logging.getLogger(__name__)
FORWARDED_ENV = ("ATTNSERVE_CACHE_DIR", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "HF_HOME", "ATTNSERVE_CHAOS")
STATE_NAMESPACE = "attnserve"
REPORT_PERIOD_S = 1.0
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve asks each replica for its cache summary and load


class MetricsHub:
    """Every model replica of an application, on any node, pushes its snapshot here, and /metrics
    renders the sum. A replica that stops reporting keeps its counters (they stay monotonic) but
    its gauges drop out after STALE_AFTER_S."""

    def __init__(self) -> None:
        self.snapshots: dict[str, MetricsSnapshot] = {}

    def report(self, replica_id: str, snapshot: MetricsSnapshot) -> None:
        held = self.snapshots.get(replica_id)
        if held is None or held.time <= snapshot.time:  # NOTE: calls may run out of order (AppStateActor)
            self.snapshots[replica_id] = snapshot

    def collect(self) -> list[MetricsSnapshot]:
        return list(self.snapshots.values())


class AppState(MetricsHub, AdapterRegistry, ResponseStore):
    """What an application's replicas share: the metrics hub, the LoRA adapters (AdapterRegistry) and
    the stored responses (ResponseStore), their methods side by side.

    NOTE: one actor, not one each: every Ray actor is a process of its own (~150 MB, about a second
    of CPU to start, and its share of Ray's background work), and these only hold small maps."""

    def __init__(self, store: StoreConfig) -> None:
        MetricsHub.__init__(self)
        AdapterRegistry.__init__(self)
        ResponseStore.__init__(self, store)


# NOTE: out of order: a call cancelled before it ran (a client that disconnects while a replica's first call
# waits for this actor to start: Serve cancels the request's calls with it) left every later call from that
# replica queued behind it, for good: /v1/models and /metrics hung (test_serve_e2e's joined CLI, 1 run in 4).
# Nothing here depends on the order of one caller's calls (MetricsHub.report keeps the newer snapshot).
AppStateActor = ray.remote(num_cpus=0, allow_out_of_order_execution=True)(AppState)


def state_name(app_name: str) -> str:
    return f"attnserve-state-{app_name}"


def app_state(app_name: str, store: StoreConfig, resources: dict[str, float] | None = None):
    """The application's AppState actor, created by whichever replica asks first, placed by `resources`
    (the ingress's: a node that may go away must not take the metrics with it). `store` applies when it
    is created: a later deployment of the same application keeps the running actor's."""
    return AppStateActor.options(name=state_name(app_name), namespace=STATE_NAMESPACE, lifetime="detached",
                                 get_if_exists=True, resources=resources or {}).remote(store)


@dataclass(frozen=True)
class LoraOptions:
    """What an HTTP replica needs of ServeConfig's LoRA keys."""

    modules: dict[str, str] = field(default_factory=dict)  # name -> path: the one served model's adapters
    allow_runtime: bool = False  # /v1/load_lora_adapter without an API key


class AdapterLease:
    """A LoRA adapter a model replica holds, as Serve's model multiplexing sees it. Past max_loras Serve
    drops the least recently used lease and calls its __del__ (in an executor thread), which unloads the
    adapter from the engine: its requests in flight finish first, and its slot is then free."""

    def __init__(self, worker: ModelWorker, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.worker, self.name, self.loop = worker, name, loop
        self.released = False

    def __del__(self) -> None:
        # NOTE: once only: Serve calls it, and garbage collection calls it again later
        if getattr(self, "released", True):
            return
        self.released = True
        try:
            done = asyncio.run_coroutine_threadsafe(self.worker.unload_adapter(self.name), self.loop)
            if not _on_loop(self.loop):  # Serve's executor thread waits; the loop itself must not
                done.result(timeout=UNLOAD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a failed unload leaves the engine's own LRU to free the slot
            logger.exception("unloading LoRA adapter %s failed", self.name)


UNLOAD_TIMEOUT_S = 30.0


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class RayStore(StoreClient):
    """StoreClient over the application's `AppState` actor (its ResponseStore methods)."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self.actor.put.remote(response_id, record)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return await self.actor.get.remote(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self.actor.delete.remote(response_id)


class _Reporter(threading.Thread):
    """Pushes the worker's metrics snapshot, with where it runs, to the hub every REPORT_PERIOD_S."""

    def __init__(self, worker: ModelWorker, hub, replica_id: str, node_id: str) -> None:
        super().__init__(name="attnserve-metrics", daemon=True)
        self.worker, self.hub, self.replica_id = worker, hub, replica_id
        self.node_id = node_id
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(REPORT_PERIOD_S):
            self.push()

    def push(self) -> None:
        try:
            snapshot = replace(self.worker.snapshot(), replica=self.replica_id, node=self.node_id)
            self.hub.report.remote(self.replica_id, snapshot)
        except Exception:  # noqa: BLE001 - metrics must never take the replica down
            logger.exception("metrics report failed")


class ModelReplica(LocalModelClient):
    """One replica = one engine (in its own process) for one model. Config arrives as arguments,
    read here in __init__. It is the local client of its worker: a RayModelClient's calls land on the
    ModelClient methods it inherits; Serve's own calls (health checks, autoscaling and routing
    stats) are here."""

    def __init__(self, name: str, engine_config: EngineConfig, hub_resources: dict[str, float] | None = None,
                 store: StoreConfig | None = None) -> None:
        super().__init__(ModelWorker(name, engine_config))
        ctx = serve.get_replica_context()
        self.state = app_state(ctx.app_name, store or StoreConfig(), hub_resources)
        self.reporter = _Reporter(self.worker, self.state, ctx.replica_id.unique_id,
                                  ray.get_runtime_context().get_node_id())
        self.reporter.push()
        self.reporter.start()
        self._lease = None
        self._refs: dict[str, LoraRef] = {}  # an adapter's name -> the ref its latest request carried
        if engine_config.max_loras:
            async def load(name: str) -> AdapterLease:
                """Serve's multiplexed load: the adapter into an engine slot (AdapterError: the request's 4xx)."""
                await self.worker.load_adapter(self._refs[name])
                return AdapterLease(self.worker, name, asyncio.get_running_loop())
            # NOTE: a closure wrapped here, not a decorated method: the decorator's limit is fixed where it
            # is applied, and ours is the engine's slot count; Serve keeps its LRU on the function object
            self._lease = serve.multiplexed(max_num_models_per_replica=engine_config.max_loras)(load)

    async def generate(self, call: GenerateCall) -> AsyncIterator[PromptInfo | Chunk]:
        if call.lora is not None and self._lease is not None:
            self._refs[call.lora.name] = call.lora
            await self._lease(call.lora.name)  # held by Serve's LRU: the router prefers this replica for it
        async for item in super().generate(call):
            yield item

    def check_health(self) -> None:
        """Serve restarts the replica when this raises (the engine process died)."""
        if not self.worker.is_healthy:
            raise RuntimeError(f"engine process is not running: {self.worker.engine.dead}")

    async def stats(self) -> dict[str, int]:
        return self.worker.stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve averages these per replica for `engine_pressure_policy`."""
        s = self.worker.engine.stats
        return autoscaling_stats(s.num_running, s.num_waiting, s.kv_usage)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve calls this about once a second; `CacheAwareRouter` reads it."""
        engine = self.worker.engine
        s = engine.stats
        return routing_stats(s.num_running, s.num_waiting, s.kv_usage, engine.cached_blocks)

    async def pid(self) -> int:
        return os.getpid()

    async def engine_pid(self) -> int:
        return self.worker.engine.pid

    def __del__(self) -> None:
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stopped.set()
            reporter.push()  # final counts survive the replica
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()


ModelDeployment = serve.deployment(health_check_period_s=5, health_check_timeout_s=30)(ModelReplica)


class _ServesApi:
    """The FastAPI app of a replica that answers HTTP, over its model clients; metrics, LoRA adapters
    and stored responses from the application's AppState actor."""

    def _serve_api(self, state, clients: dict, limits: ApiLimits, api_key: str | None,
                   lora: LoraOptions | None = None) -> None:
        # NOTE: `state` is the replica's one handle on its AppState: a ModelServer's second get_if_exists
        # of the actor its own __init__ had just created left /v1/models awaiting it forever (1 run in 2)
        self.state = state
        lora = lora or LoraOptions()
        self.api = OpenAIApi(clients, limits, RemoteAdapters(self.state), lora.modules, lora.allow_runtime,
                             self.snapshots)
        self.api_key = api_key
        self.responses = RayStore(self.state)

    async def snapshots(self) -> list[MetricsSnapshot]:
        return await self.state.collect.remote()

    def __serve_build_asgi_app__(self):
        return create_app(self.api, self.api_key, self.snapshots, self.responses)


@serve.deployment(health_check_period_s=5, health_check_timeout_s=30)
@serve.ingress()
class ModelServer(ModelReplica, _ServesApi):
    """A one-model application's replica serves the OpenAI API itself: one Ray hop fewer per
    streamed token than proxy -> ingress -> model replica (a streaming burst 6.3 s -> 5.1 s)."""

    def __init__(self, name: str, engine_config: EngineConfig, limits: ApiLimits, api_key: str | None,
                 hub_resources: dict[str, float] | None = None, store: StoreConfig | None = None,
                 lora: LoraOptions | None = None) -> None:
        super().__init__(name, engine_config, hub_resources, store)
        self._serve_api(self.state, {name: self}, limits, api_key, lora)


class RayModelClient(ModelClient):
    """ModelClient over a Serve handle to a `ModelReplica`; closing a stream cancels the request there.

    With a tokenizer (cache-aware routing), prompts are tokenized here, once, and their full
    blocks hashed as the prefix cache hashes them, so the router can see what they share."""

    def __init__(self, handle: DeploymentHandle, tokenizer: Any = None, name: str = "") -> None:
        self.handle = handle
        self.stream_handle = handle.options(stream=True)
        self.tokenizer, self.name = tokenizer, name
        self._block_size: int | None = None

    async def _routable(self, call: GenerateCall) -> GenerateCall:
        if self.tokenizer is None:
            return call
        if self._block_size is None:
            self._block_size = (await self.info()).block_size
        ids = call.prompt_token_ids
        if ids is None:
            # NOTE: with the call's tools and template arguments: the model replica takes these ids as the prompt
            ids = tuple(encode_prompt(self.tokenizer, self.name, call.prompt, call.messages, tools=call.tools,
                                      template_kwargs=call.chat_template_kwargs))
        # NOTE: an adapter's blocks are hashed from its salt, as its replica's prefix cache keys them
        salt = call.lora.salt if call.lora is not None else None
        return replace(call, prompt=None, messages=None, tools=None, chat_template_kwargs=None, prompt_token_ids=ids,
                       block_hashes=tuple(prompt_block_hashes(ids, self._block_size, salt=salt)))

    async def generate(self, call: GenerateCall) -> AsyncIterator[PromptInfo | Chunk]:
        # an adapter's request goes to a replica holding it where one does (Serve's model multiplexing)
        handle = (self.stream_handle if call.lora is None
                  else self.stream_handle.options(multiplexed_model_id=call.lora.name))
        response = handle.generate.remote(await self._routable(call))
        try:
            async for item in response:
                yield item
        finally:
            response.cancel()

    async def _call(self, method: str, *args: Any) -> Any:
        """The replica's method of the same name (ModelReplica is a LocalModelClient)."""
        return await getattr(self.handle, method).remote(*args)

    async def info(self) -> ModelInfo:
        return await self._call("info")

    async def health(self) -> bool:
        return await self._call("health")

    async def embed(self, call: EmbedCall) -> Embeddings:
        return await self._call("embed", call)

    async def encode(self, prompt, messages, add_special_tokens: bool, tools=None, template_kwargs=None) -> list[int]:
        return await self._call("encode", prompt, messages, add_special_tokens, tools, template_kwargs)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._call("decode", token_ids)

    async def attention(self, call: AttentionCall) -> AttentionMap:
        return await self._call("attention", call)

    async def inject_step_failures(self, count: int) -> None:
        await self._call("inject_step_failures", count)

    async def slow_steps(self, delay_s: float) -> None:
        await self._call("slow_steps", delay_s)


@serve.deployment(max_ongoing_requests=2048, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIIngress(_ServesApi):
    """Owns the FastAPI app, built in the replica from the handles of the model deployments."""

    def __init__(self, models: dict[str, DeploymentHandle], limits: ApiLimits, api_key: str | None,
                 tokenize: dict[str, str] | None = None, hub_resources: dict[str, float] | None = None,
                 store: StoreConfig | None = None, lora: LoraOptions | None = None) -> None:
        """`tokenize`: model name -> source, for the models routed by cache (tokenized here)."""
        tokenizers = {name: load_tokenizer(resolve_model(source)) for name, source in (tokenize or {}).items()}
        state = app_state(serve.get_replica_context().app_name, store or StoreConfig(), hub_resources)
        self._serve_api(state, {name: RayModelClient(h, tokenizers.get(name), name) for name, h in models.items()},
                        limits, api_key, lora)


def _deployment_name(model: str) -> str:
    return "model-" + re.sub(r"[^A-Za-z0-9_-]", "-", model)


def _cluster_cpus() -> float | None:
    return ray.cluster_resources().get("CPU") if ray.is_initialized() else None


def build_app(args: dict[str, Any] | ServeConfig | None = None) -> serve.Application:
    """The bound Serve application for `args` (a ServeConfig or its dict form, e.g. from serve.yaml)."""
    cfg = args if isinstance(args, ServeConfig) else ServeConfig.from_args(args)
    cpus = cfg.replica_cpus(_cluster_cpus())
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    actor_options: dict[str, Any] = {"num_cpus": cpus, "runtime_env": {"env_vars": env},
                                     "resources": dict(cfg.replica_resources)}
    if cfg.num_gpus:
        actor_options["num_gpus"] = cfg.num_gpus
    # a sharded model's replica holds no CPU itself: its workers hold the replica's share
    replica_options = dict(actor_options, num_cpus=0) if cfg.engine.world_size > 1 else actor_options
    models, tokenize = {}, {}
    lora = LoraOptions(dict(cfg.lora_modules), cfg.allow_runtime_lora)
    for name, source in cfg.models.items():
        scaling = ({"autoscaling_config": autoscaling_config(cfg.autoscaling)} if cfg.autoscaling
                   else {"num_replicas": cfg.replicas(name)})
        options = dict(name=_deployment_name(name), max_ongoing_requests=cfg.max_ongoing_requests,
                       ray_actor_options=replica_options, graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
                       **scaling, **worker_placement(cfg.engine_config(source, cpus), actor_options))
        # routing by cache needs the prompt's tokens before a replica is chosen, and routing by adapter
        # the request's `model` (Serve's HTTP proxy reads no body): an ingress
        by_adapter = cfg.serves_lora and cfg.most_replicas(name) > 1
        if len(cfg.models) == 1 and not cfg.separate_ingress and not cfg.routes_by_cache(name) and not by_adapter:
            return ModelServer.options(**options).bind(name, cfg.engine_config(source, cpus), cfg.limits, cfg.api_key,
                                                       cfg.ingress_resources, cfg.responses_store, lora)
        if cfg.routes_by_cache(name):
            tokenize[name] = source
            options["request_router_config"] = RequestRouterConfig(
                request_router_class=CacheAwareRouter, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
        models[name] = ModelDeployment.options(**options).bind(name, cfg.engine_config(source, cpus),
                                                               cfg.ingress_resources, cfg.responses_store)
    ingress_options = {"num_cpus": 0, "runtime_env": {"env_vars": env}, "resources": dict(cfg.ingress_resources)}
    return OpenAIIngress.options(ray_actor_options=ingress_options,
                                 graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s).bind(
        models, cfg.limits, cfg.api_key, tokenize, cfg.ingress_resources, cfg.responses_store, lora)


def worker_placement(engine: EngineConfig, actor_options: dict[str, Any]) -> dict[str, Any]:
    """A sharded model's replica reserves its workers with itself, as Ray Serve LLM does: one bundle per
    rank (server/engine/executor.py places rank i in bundle i), the replica's own actor in bundle 0 with no
    CPU of its own (its engine process only schedules and samples). Serve counts, starts and stops the
    whole group as one replica."""
    if engine.world_size == 1:
        return {}

    bundles = worker_bundles(engine)
    bundles[0] = {**bundles[0], **actor_options.get("resources", {})}
    return {"placement_group_bundles": bundles, "placement_group_strategy": placement_strategy(engine.pipeline_parallel_size)}


def required_cpus(cfg: ServeConfig, cluster_cpus: float | None) -> float:
    """CPUs the model replicas ask for at start: more than the cluster has would hang serve.run."""
    return cfg.replica_cpus(cluster_cpus) * cfg.total_replicas
