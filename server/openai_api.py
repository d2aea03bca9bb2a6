"""OpenAI semantics on top of model clients: routing by `model`, limits, and merging the engine's
streams into one response, streamed (SSE) or whole. Request fields become engine values in
api_request.py, chunks become response bodies in api_response.py. Transport-agnostic: the clients
are Ray Serve handles in production and plain ModelWorkers in unit tests."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from models.lora_format import AdapterError
from server.api_request import ApiError, ApiLimits, chat_request, sampling_params, structured, template_input
from server.api_response import ChoiceBuilder, sse, usage, usage_so_far, vllm_prompt_logprobs
from server.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from server.engine.pooling import serves, truncate
from server.kv_forms import kv_curve
from server.lora_registry import Adapters, LocalAdapters, checked_ref
from server.metrics import fresh
from server.model_client import ModelClient
from server.protocol import (
    AttentionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    error_body,
)
from server.tools import ToolChoice
from server.wire import AttentionCall, Chunk, EmbedCall, GenerateCall, LoraRef, MetricsSnapshot, ModelInfo, PromptInfo

__all__ = ["ApiError", "ApiLimits", "ModelClient", "OpenAIApi", "SSEStream"]


HEALTH_TIMEOUT_S = 2.0
logger = logging.getLogger(__name__)


class OpenAIApi:
    """`adapters`: the application's LoRA registry (server/lora_registry.py); `lora_modules`: adapters
    (name -> path) of the only served model, registered on first use; `allow_runtime_lora`: POST
    /v1/load_lora_adapter without an API key (http_app refuses it otherwise); `snapshots`: every
    replica's metrics, for which replicas hold which adapters."""

    def __init__(self, clients: dict[str, ModelClient], limits: ApiLimits | None = None,
                 adapters: Adapters | None = None, lora_modules: dict[str, str] | None = None,
                 allow_runtime_lora: bool = False,
                 snapshots: Callable[[], Awaitable[list[MetricsSnapshot]]] | None = None) -> None:
        self.clients = clients
        self.limits = limits or ApiLimits()
        self.adapters = adapters or LocalAdapters()
        self.lora_modules = dict(lora_modules or {})
        self.allow_runtime_lora = allow_runtime_lora
        self.snapshots = snapshots
        self._registration: asyncio.Future | None = None  # registering lora_modules, or done
        self._module_errors: dict[str, str] = {}  # a --lora-modules adapter that could not be served -> why
        self._infos: dict[str, ModelInfo] = {}
        self.num_streams = 0

    # ---- helpers ---------------------------------------------------------------------------
    def _not_found(self, name: str) -> ApiError:
        why = f" (its --lora-modules entry failed: {self._module_errors[name]})" if name in self._module_errors else ""
        return ApiError(404, f"The model `{name}` does not exist{why}. Available: {', '.join(self.clients)}",
                        param="model", code="model_not_found")

    def _client(self, name: str) -> ModelClient:
        """A served base model's client (not an adapter's)."""
        if name not in self.clients:
            raise self._not_found(name)
        return self.clients[name]

    async def _target(self, name: str) -> tuple[str, ModelClient, LoraRef | None]:
        """What a request's `model` names: a base model, or a LoRA adapter on its parent."""
        if name in self.clients:
            return name, self.clients[name], None
        await self._register_modules()
        ref = await self.adapters.get(name)
        if ref is None or ref.parent not in self.clients:
            raise self._not_found(name)
        return ref.parent, self.clients[ref.parent], ref

    async def _base_only(self, name: str, what: str) -> ModelClient:
        """A base model's client; an adapter's name is a 400 for endpoints adapters do not change."""
        parent, client, ref = await self._target(name)
        if ref is not None:
            raise ApiError(400, f"{name!r} is a LoRA adapter of {parent!r}: {what} serves base models only; "
                           f"use model {parent!r}", param="model")
        return client

    async def _info(self, name: str) -> ModelInfo:
        if name not in self._infos:
            self._infos[name] = await self._client(name).info()
        return self._infos[name]

    async def _register_modules(self) -> None:
        """--lora-modules, checked against the served model on first use, once for all requests that
        wait on it (NOTE: every ingress replica registers them; a name another replica registered
        already is the same adapter). A failure to reach the model is retried by the next request."""
        if not self.lora_modules:
            return
        if self._registration is None:
            self._registration = asyncio.ensure_future(self._register(next(iter(self.clients))))
        try:
            await asyncio.shield(self._registration)
        except Exception as e:  # noqa: BLE001 - e.g. no replica of the model up yet
            self._registration = None
            raise _as_api_error(e) from None

    async def _register(self, parent: str) -> None:
        for name, path in self.lora_modules.items():
            try:
                ref = checked_ref(name, parent, path, await self._info(parent))
            except AdapterError as e:
                logger.error("LoRA adapter %s (%s) cannot be served: %s", name, path, e)
                self._module_errors[name] = str(e)
                continue
            await self.adapters.add(ref)

    async def _start(self, client: ModelClient, calls: list[GenerateCall]) -> list[tuple[AsyncIterator, PromptInfo]]:
        """Open every stream and read its PromptInfo, so bad input fails before any byte is sent."""
        started: list[tuple[AsyncIterator, PromptInfo]] = []
        try:
            for call in calls:
                gen = client.generate(call)
                started.append((gen, await gen.__anext__()))
        except BaseException as e:
            for gen, _ in started:
                await gen.aclose()
            raise _as_api_error(e) from None
        return started

    async def _merge(self, streams: list[tuple[AsyncIterator, PromptInfo]],
                     ended: Callable[[int], bool] = lambda i: False) -> AsyncIterator[tuple[int, Chunk]]:
        """Interleave the prompts' chunks as they come; closing this closes (aborts) them all.
        `ended(i)`, asked after each chunk of prompt i is consumed: the API ended every sample of
        it early, so its stream is closed now (aborted: its KV blocks are freed)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator) -> None:
            try:
                async for chunk in gen:
                    await queue.put((i, chunk))
                await queue.put((i, None))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, gen)) for i, (gen, _) in enumerate(streams)]
        remaining, closed = len(tasks), set()
        try:
            while remaining:
                i, item = await queue.get()
                if i in closed:
                    continue
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise _as_api_error(item)
                else:
                    yield i, item
                    if ended(i):
                        closed.add(i)
                        remaining -= 1
                        tasks[i].cancel()  # NOTE: cancelling the pump closes its stream, which aborts the request
                        await asyncio.gather(tasks[i], return_exceptions=True)
                        await _close(streams[i][0])
        finally:
            for t in tasks:
                t.cancel()
            for gen, _ in streams:
                await _close(gen)

    def _release_stream(self) -> None:
        self.num_streams -= 1

    def _admit_stream(self) -> None:
        if self.num_streams >= self.limits.max_concurrent_streams:
            raise ApiError(429, "too many concurrent requests; retry later", type_="rate_limit_error",
                           code="too_many_requests", headers={"Retry-After": "1"})
        self.num_streams += 1

    # ---- endpoints -------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        data = []
        for name in self.clients:
            info = await self._info(name)
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "attnserve",
                         "max_model_len": info.max_model_len, "attention": info.attention,
                         "num_kv_heads": info.num_kv_heads, "kv_bytes_per_token": info.kv_bytes_per_token,
                         "kv_cache_dtype": info.kv_cache_dtype, "quantization": info.quantization,
                         "weight_bytes": info.weight_bytes, "speculative": info.speculative,
                         "reasoning_parser": info.reasoning_parser, "scheduling_policy": info.scheduling_policy,
                         # generate, embed (/v1/embeddings only) or generate,embed: the pooling and width
                         "task": info.task, "pooling": info.pooling.as_dict() if info.pooling else None,
                         "hidden_size": info.hidden_size,
                         "cpu_path": info.cpu_path.as_dict(),
                         # kv_bytes_per_token is a token of every layer; with sliding-window layers
                         # (layer_windows: per layer a window or null, [] = every layer global) a
                         # sequence costs less per token the longer it is: kv_bytes_per_token_at
                         "layer_windows": list(info.layer_windows),
                         "attention_variants": list(info.attention_variants),
                         "block_size": info.block_size,
                         "kv_block_bytes": info.kv_block_bytes or info.kv_bytes_per_token * info.block_size,
                         "kv_bytes_per_token_at": kv_curve(info.kv_bytes_per_token, info.layer_windows,
                                                           info.block_size),
                         "tensor_parallel_size": info.tensor_parallel_size,
                         "pipeline_parallel_size": info.pipeline_parallel_size,
                         "workers": [dataclasses.asdict(w) for w in info.workers]})
        await self._register_modules()
        adapters = await self.adapters.all()
        holders = await self._adapter_replicas() if adapters else {}
        for name, ref in sorted(adapters.items()):
            # as vLLM lists an adapter (root: its path, parent: the base), and where it is loaded now
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "attnserve", "root": ref.path,
                         "parent": ref.parent, "max_model_len": (await self._info(ref.parent)).max_model_len,
                         "lora": {"replicas": holders.get((ref.parent, name), [])}})
        return {"object": "list", "data": data}

    async def _adapter_replicas(self) -> dict[tuple[str, str], list[str]]:
        """(model, adapter) -> the replicas that hold the adapter now, from their metrics reports."""
        if self.snapshots is None:
            return {}
        held: dict[tuple[str, str], list[str]] = {}
        for s in fresh(await self.snapshots(), time.time()):
            for name in s.loras:
                held.setdefault((s.model, name), []).append(s.replica)
        return {k: sorted(v) for k, v in held.items()}

    async def load_lora_adapter(self, body: LoadLoraAdapterRequest) -> dict[str, Any]:
        """vLLM's POST /v1/load_lora_adapter: the adapter is checked against its base here, then
        registered; replicas load it on its first request. A name in use is a 400, as in vLLM."""
        await self._register_modules()
        base = body.base_model
        if base is None:
            if len(self.clients) != 1:
                raise ApiError(400, f"several models are served ({', '.join(self.clients)}): name one in base_model",
                               param="base_model")
            base = next(iter(self.clients))
        if base not in self.clients:
            raise ApiError(404, f"base_model {base!r} is not served", param="base_model", code="model_not_found")
        if body.lora_name in self.clients or await self.adapters.get(body.lora_name) is not None:
            raise ApiError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        try:
            ref = checked_ref(body.lora_name, base, body.lora_path, await self._info(base))
        except AdapterError as e:
            raise _as_api_error(e) from None
        if not await self.adapters.add(ref):  # NOTE: another replica took the name meanwhile
            raise ApiError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        self._module_errors.pop(body.lora_name, None)
        return {"object": "lora_adapter", "id": ref.name, "parent": base, "root": ref.path, "status": "loaded",
                "message": f"Success: LoRA adapter '{ref.name}' added successfully."}

    async def unload_lora_adapter(self, body: UnloadLoraAdapterRequest) -> dict[str, Any]:
        """vLLM's POST /v1/unload_lora_adapter: new requests naming it get 404 from now on; those in
        flight finish. An unknown name is a 404."""
        await self._register_modules()
        ref = await self.adapters.remove(body.lora_name)
        if ref is None:
            raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        try:
            await self.clients[ref.parent].unload_adapter(ref.name)
        except Exception:  # noqa: BLE001 - the registry decides; a replica drops it later anyway (LRU)
            logger.exception("unloading LoRA adapter %s from its replica failed", ref.name)
        return {"object": "lora_adapter", "id": ref.name, "status": "unloaded",
                "message": f"Success: LoRA adapter '{ref.name}' removed successfully."}

    async def health(self) -> dict[str, bool]:
        async def one(client: ModelClient) -> bool:
            try:
                # NOTE: with no live replica a Serve handle waits for one to come back; a probe
                # needs "unhealthy" now, well inside a typical 5 s probe timeout
                return bool(await asyncio.wait_for(client.health(), timeout=HEALTH_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - any failure means unhealthy
                return False
        results = await asyncio.gather(*(one(c) for c in self.clients.values()))
        return dict(zip(self.clients, results))

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        parent, client, _ = await self._target(body.model)  # an adapter tokenizes as its base
        info = await self._info(parent)
        messages = list(template_input(body.messages)) if body.messages else None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            ids = await client.encode(body.prompt, messages, body.add_special_tokens, tools, body.chat_template_kwargs)
        except BaseException as e:
            raise _as_api_error(e) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len}

    async def attention(self, body: AttentionRequest) -> dict[str, Any]:
        """Attention weights (heads x query x key) per layer, from the reference formula."""
        client = await self._base_only(body.model, "/v1/attention")
        prompt = body.prompt if isinstance(body.prompt, str) else None
        ids = tuple(body.prompt) if isinstance(body.prompt, list) else None
        messages = template_input(body.messages) if body.messages else None
        call = AttentionCall(prompt, ids, messages, tuple(body.layers) if body.layers else None,
                             self.limits.max_attention_tokens)
        try:
            result = await client.attention(call)
        except BaseException as e:
            raise _as_api_error(e) from None
        # weights come with windows and sinks applied: a key outside a layer's sliding window
        # weighs 0, and with sinks a row sums to 1 minus the sink's share
        windows = result.windows or (None,) * len(result.layers)
        return {"model": body.model, "tokens": list(result.tokens), "token_ids": list(result.token_ids),
                "layers": [{"layer": i, "weights": w, "window": window, "sinks": result.sinks}
                           for (i, w), window in zip(result.layers, windows)]}

    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        """Each input's embedding (the model's pooling of its final hidden states), in input order; `usage`
        counts the inputs' tokens. A model whose task has embed only: a generate-only one is a 400."""
        client = await self._base_only(body.model, "/v1/embeddings")
        try:
            info = await self._info(body.model)
        except BaseException as e:
            raise _as_api_error(e) from None
        if not serves(info.task, "embed"):
            raise ApiError(400, f"model {body.model!r} serves text generation, not embeddings (its task is "
                           f"{info.task}; serve an embedding model, or start it with --task embed or generate,embed)",
                           param="model")
        if body.dimensions is not None and body.dimensions > info.hidden_size:
            raise ApiError(400, f"dimensions ({body.dimensions}) exceeds the model's embedding size of "
                           f"{info.hidden_size}", param="dimensions")
        inputs = body.inputs()
        if len(inputs) > self.limits.max_embedding_inputs:
            raise ApiError(400, f"at most {self.limits.max_embedding_inputs} inputs per request", param="input")
        call = EmbedCall(tuple(x if isinstance(x, str) else tuple(x) for x in inputs), f"embd-{uuid.uuid4().hex}")
        self._admit_stream()
        try:
            result = await client.embed(call)
        except BaseException as e:
            raise _as_api_error(e) from None
        finally:
            self._release_stream()
        data = [{"object": "embedding", "index": i,
                 "embedding": embedding_value(v, body.dimensions, body.encoding_format)}
                for i, v in enumerate(result.vectors)]
        tokens = result.num_prompt_tokens
        return {"object": "list", "data": data, "model": body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        _, client, _ = await self._target(body.model)
        try:
            return {"prompt": await client.decode(body.tokens)}
        except BaseException as e:
            raise _as_api_error(e) from None

    async def completions(self, body: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        parent, client, lora = await self._target(body.model)
        prompts = body.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise ApiError(400, f"at most {self.limits.max_prompts} prompts per request", param="prompt")
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens 0 is only allowed with echo (the prompt scored, nothing generated)",
                           param="max_tokens")
        params = sampling_params(body, self.limits, body.max_tokens, body.logprobs, structured(body))
        if body.echo and body.logprobs is not None:  # NOTE: echo's logprobs are the prompt's, from its prefill
            params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs, params.prompt_logprobs or 0))
        rid = f"cmpl-{uuid.uuid4().hex}"
        # NOTE: a text prompt is echoed as given; token ids as the replica decodes them
        calls = [GenerateCall(params, prompt=p if isinstance(p, str) else None,
                              prompt_token_ids=tuple(p) if isinstance(p, list) else None, request_id=f"{rid}-{i}",
                              stream=body.stream, echo=body.echo and not isinstance(p, str), lora=lora)
                 for i, p in enumerate(prompts)]
        echoes = [p if isinstance(p, str) else None for p in prompts] if body.echo else None
        return await self._run(client, parent, calls, body, rid, "text_completion", chat=False, echoes=echoes)

    async def chat(self, body: ChatCompletionRequest, raw: bool = False) -> dict[str, Any] | AsyncIterator:
        """`raw`: a streamed answer's events as dicts (the chunk objects, an `{"error": ...}` body),
        without SSE framing or `[DONE]`: the other APIs (Responses, Messages) translate them."""
        parent, client, lora = await self._target(body.model)
        req = chat_request(body, self.limits)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        # NOTE: a tool parser that may end the answer early reads it as it comes, also for a whole answer
        stream = body.stream or (req.parsing is not None and req.parsing.stops_early)
        call = GenerateCall(req.params, messages=req.messages, request_id=f"{rid}-0", fit_max_tokens=req.fit_max_tokens,
                            stream=stream, tools=req.tools, chat_template_kwargs=req.template_kwargs, chat=True,
                            lora=lora)
        return await self._run(client, parent, [call], body, rid, "chat.completion", chat=True, tools=req.parsing,
                               raw=raw)

    async def _run(self, client, parent: str, calls, body, rid: str, obj: str, chat: bool,
                   tools: ToolChoice | None = None, raw: bool = False,
                   echoes: list[str | None] | None = None) -> dict[str, Any] | AsyncIterator:
        """`parent`: the served model `client` runs (an adapter's base). `echoes`: completions' echo, per
        prompt its text (None: the replica's decoding of its token ids)."""
        try:
            speculative = (await self._info(parent)).speculative is not None  # usage then counts drafts
        except BaseException as e:
            raise _as_api_error(e) from None
        self._admit_stream()
        try:
            streams = await self._start(client, calls)
        except BaseException:
            self._release_stream()
            raise
        created, n = int(time.time()), body.n
        choices = [ChoiceBuilder(i, chat, tools, streams[i // n][1].reasoning,
                                 echo=None if echoes is None else echoes[i // n] or streams[i // n][1].prompt_text or "",
                                 logprobs=None if chat else body.logprobs)
                   for i in range(len(streams) * n)]

        def ended(i: int) -> bool:
            """Every sample of prompt i ended, one of them by the API (ChoiceBuilder.stopped)."""
            mine = choices[i * n:(i + 1) * n]
            return any(c.stopped for c in mine) and all(c.sample.finish_reason is not None for c in mine)

        infos = [info for _, info in streams]
        if body.stream:
            opts = body.stream_options
            usage_mode = ("continuous" if opts and opts.continuous_usage_stats else
                          "final" if opts and opts.include_usage else None)
            head = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created, "model": body.model}
            return SSEStream(self._stream(streams, choices, n, head, chat, usage_mode, speculative, ended), streams,
                             self._release_stream, None if raw else sse)
        try:
            async for i, chunk in self._merge(streams, ended):
                choices[i * n + chunk.index].add(chunk)
        finally:
            self._release_stream()
        answer = {"id": rid, "object": obj, "created": created, "model": body.model,
                  "choices": [c.whole() for c in choices],
                  "usage": usage(infos, [c.sample for c in choices], speculative)}
        if body.prompt_logprobs is not None:  # vLLM's places: per choice of a completion, once for a chat
            if chat:
                answer["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].sample.prompt_logprobs)
            else:
                for c, whole in zip(choices, answer["choices"]):
                    whole["prompt_logprobs"] = vllm_prompt_logprobs(c.sample.prompt_logprobs)
        return answer

    async def _stream(self, streams, choices: list[ChoiceBuilder], n: int, head: dict[str, Any], chat: bool,
                      usage_mode: str | None, speculative: bool,
                      ended: Callable[[int], bool]) -> AsyncIterator[dict[str, Any] | str]:
        """The events as dicts, then "[DONE]". `usage_mode`: None, "final" (one last usage chunk) or
        "continuous" (usage so far on every chunk too)."""
        infos, samples = [info for _, info in streams], [c.sample for c in choices]
        try:
            if chat:
                for j in range(len(choices)):
                    yield {**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
            async for i, chunk in self._merge(streams, ended):
                events = choices[i * n + chunk.index].add(chunk)
                if chunk.error:
                    yield error_body(chunk.error, "server_error", code=500)
                    continue
                for k, choice in enumerate(events):
                    event = {**head, "choices": [choice]}
                    if usage_mode == "continuous" and k == len(events) - 1:
                        event["usage"] = usage_so_far(infos, samples)
                    yield event
            if usage_mode is not None:
                yield {**head, "choices": [], "usage": usage(infos, samples, speculative)}
        except ApiError as e:
            yield e.body()
        yield "[DONE]"


class SSEStream:
    """The SSE body of one streaming response (`encode` frames each event; None: the events as they
    are, without the final "[DONE]"). Closing it, even before the first event, aborts the
    generation and gives back its concurrent-stream slot (exactly once)."""

    def __init__(self, events: AsyncIterator, engine_streams: list, release,
                 encode: Callable[[Any], str] | None = sse) -> None:
        self.events, self.engine_streams, self._release, self.encode = events, engine_streams, release, encode

    def __aiter__(self) -> SSEStream:
        return self

    async def __anext__(self) -> Any:
        try:
            event = await self.events.__anext__()
            if self.encode is None and event == "[DONE]":
                raise StopAsyncIteration
        except BaseException:
            await self.aclose()
            raise
        return event if self.encode is None else self.encode(event)

    async def aclose(self) -> None:
        release, self._release = self._release, None
        if release is None:
            return
        await _close(self.events)
        for gen, _ in self.engine_streams:  # no-ops when the events already closed them
            await _close(gen)
        release()


def embedding_value(vector: Any, dimensions: int | None, encoding: str) -> list[float] | str:
    """One embedding as OpenAI sends it: its first `dimensions` values (Matryoshka: renormalised, pooling.truncate),
    as floats or as base64 of little-endian float32."""
    v = truncate(vector, dimensions)
    return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if encoding == "base64" else v.tolist()


def _as_api_error(e: BaseException) -> BaseException:
    if isinstance(e, ApiError):
        return e
    # NOTE: an error raised in a model replica arrives wrapped (Ray's RayTaskError, a subclass of
    # the original whose message carries Ray's task header); the client sees the original's
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and isinstance(e, type(cause)):
        e = cause
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e), param=getattr(e, "param", None))
    if isinstance(e, AdapterError):  # a LoRA adapter that cannot be served: 400, or 404 for one gone
        return ApiError(e.status, str(e), param=e.param, code="model_not_found" if e.status == 404 else None)
    if isinstance(e, QueueFullError):
        return ApiError(429, str(e), type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, asyncio.CancelledError):
        return e
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), type_="server_error", code="engine_dead")
    return ApiError(503, f"model replica failed: {type(e).__name__}: {e}", type_="server_error", code="replica_error")


async def _close(gen: AsyncIterator) -> None:
    try:
        await gen.aclose()
    except BaseException:  # noqa: BLE001 - closing a broken stream must not mask the real error
        pass
