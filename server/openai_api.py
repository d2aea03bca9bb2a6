"""OpenAI semantics on top of model clients: routing by `model`, sampling parameters,
multiple prompts and samples, streaming (SSE) and usage. Transport-agnostic: the clients
are Ray Serve handles in production and plain ModelWorkers in unit tests."""
from __future__ import annotations

import dataclasses

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from server.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from server.engine.sampling_params import SamplingParams, StructuredOutput
from server.kv_forms import kv_curve
from server.protocol import (AttentionRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                             TokenizeRequest, error_body)
from server.tools import ToolCallParser, ToolChoice, assemble, call_schema
from server.wire import AttentionCall, AttentionMap, Chunk, GenerateCall, LogprobEntry, ModelInfo, PromptInfo


class ModelClient(Protocol):
    async def info(self) -> ModelInfo: ...
    async def health(self) -> bool: ...
    def generate(self, call: GenerateCall) -> AsyncIterator[PromptInfo | Chunk]: ...
    async def encode(self, prompt: str | None, messages: list[dict] | None, add_special_tokens: bool) -> list[int]: ...
    async def decode(self, token_ids: list[int]) -> str: ...
    async def attention(self, call: AttentionCall) -> AttentionMap: ...


HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ApiLimits:
    max_n: int = 16
    max_tokens: int = 8192
    max_prompts: int = 32
    max_body_bytes: int = 4 * 2**20
    max_concurrent_streams: int = 1024
    max_attention_tokens: int = 512  # POST /v1/attention: its answer grows with the prompt's square

    def __post_init__(self) -> None:
        if min(self.max_n, self.max_tokens, self.max_prompts, self.max_body_bytes, self.max_concurrent_streams,
               self.max_attention_tokens) < 1:
            raise ValueError("API limits must be positive")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.type, self.param, self.code)


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass
class _Sample:
    text: str = ""
    num_tokens_so_far: int = 0
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    peak_kv_bytes: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class OpenAIApi:
    def __init__(self, clients: dict[str, ModelClient], limits: ApiLimits | None = None) -> None:
        self.clients = clients
        self.limits = limits or ApiLimits()
        self._infos: dict[str, ModelInfo] = {}
        self.num_streams = 0

    # ---- helpers ---------------------------------------------------------------------------
    def _client(self, name: str) -> ModelClient:
        if name not in self.clients:
            raise ApiError(404, f"The model `{name}` does not exist. Available: {', '.join(self.clients)}",
                           param="model", code="model_not_found")
        return self.clients[name]

    async def _info(self, name: str) -> ModelInfo:
        if name not in self._infos:
            self._infos[name] = await self._client(name).info()
        return self._infos[name]

    def _params(self, body, max_tokens: int | None, logprobs: int | None,
                structured: StructuredOutput | None) -> SamplingParams:
        if body.n > self.limits.max_n:
            raise ApiError(400, f"n must be <= {self.limits.max_n}", param="n")
        if max_tokens is not None and max_tokens > self.limits.max_tokens:
            raise ApiError(400, f"max_tokens must be <= {self.limits.max_tokens}", param="max_tokens")
        kw: dict[str, Any] = {"n": body.n, "ignore_eos": body.ignore_eos, "logprobs": logprobs,
                              "max_tokens": max_tokens or self.limits.max_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(body, name) is not None:
                kw[name] = getattr(body, name)
        kw["stop"] = tuple(body.stop or ())
        kw["stop_token_ids"] = tuple(body.stop_token_ids or ())
        kw["structured"] = structured
        try:
            return SamplingParams(**kw)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None

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

    async def _merge(self, streams: list[tuple[AsyncIterator, PromptInfo]]) -> AsyncIterator[tuple[int, Chunk]]:
        """Interleave the prompts' chunks as they come; closing this closes (aborts) them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator) -> None:
            try:
                async for chunk in gen:
                    await queue.put((i, chunk))
                await queue.put((i, None))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, gen)) for i, (gen, _) in enumerate(streams)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise _as_api_error(item)
                else:
                    yield i, item
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
                         "cpu_path": info.cpu_path.as_dict(),
                         # NOTE: kv_bytes_per_token is a token of every layer; with sliding-window layers
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
        return {"object": "list", "data": data}

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
        client, info = self._client(body.model), await self._info(body.model)
        messages = list(_template_input(body.messages)) if body.messages else None
        try:
            ids = await client.encode(body.prompt, messages, body.add_special_tokens)
        except BaseException as e:
            raise _as_api_error(e) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len}

    async def attention(self, body: AttentionRequest) -> dict[str, Any]:
        """Attention weights (heads x query x key) per layer, from the reference formula."""
        client = self._client(body.model)
        prompt = body.prompt if isinstance(body.prompt, str) else None
        ids = tuple(body.prompt) if isinstance(body.prompt, list) else None
        messages = _template_input(body.messages) if body.messages else None
        call = AttentionCall(prompt, ids, messages, tuple(body.layers) if body.layers else None,
                             self.limits.max_attention_tokens)
        try:
            result = await client.attention(call)
        except BaseException as e:
            raise _as_api_error(e) from None
        # NOTE: weights come with windows and sinks applied: a key outside a layer's sliding window
        # weighs 0, and with sinks a row sums to 1 minus the sink's share
        windows = result.windows or (None,) * len(result.layers)
        return {"model": body.model, "tokens": list(result.tokens), "token_ids": list(result.token_ids),
                "layers": [{"layer": i, "weights": w, "window": window, "sinks": result.sinks}
                           for (i, w), window in zip(result.layers, windows)]}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        client = self._client(body.model)
        try:
            return {"prompt": await client.decode(body.tokens)}
        except BaseException as e:
            raise _as_api_error(e) from None

    async def completions(self, body: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        client = self._client(body.model)
        prompts = body.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise ApiError(400, f"at most {self.limits.max_prompts} prompts per request", param="prompt")
        params = self._params(body, body.max_tokens, body.logprobs, _structured(body))
        rid = f"cmpl-{uuid.uuid4().hex}"
        calls = [GenerateCall(params, prompt=p if isinstance(p, str) else None,
                              prompt_token_ids=tuple(p) if isinstance(p, list) else None, request_id=f"{rid}-{i}",
                              stream=body.stream)
                 for i, p in enumerate(prompts)]
        return await self._run(client, calls, body, rid, "text_completion", chat=False)

    async def chat(self, body: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        client = self._client(body.model)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        requested = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = _tool_choice(body, tools)
        schema = call_schema(tools, choice) if choice is not None else None
        structured = _structured(body)
        if schema is not None:
            if structured is not None:
                raise ApiError(400, "a required or named tool_choice fixes the answer's format: drop "
                               "response_format or structured_outputs", param="tool_choice")
            structured = StructuredOutput("json", json.dumps(schema), label="tool_call", param="tools")
        params = self._params(body, requested, logprobs, structured)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        messages = _template_input(body.messages)
        call = GenerateCall(params, messages=messages, request_id=f"{rid}-0", fit_max_tokens=requested is None,
                            stream=body.stream, tools=tuple(tools) if tools and choice.mode != "none" else None)
        parsing = choice if choice is not None and choice.mode != "none" else None
        return await self._run(client, [call], body, rid, "chat.completion", chat=True, tools=parsing)

    async def _run(self, client, calls, body, rid: str, obj: str, chat: bool,
                   tools: ToolChoice | None = None) -> dict[str, Any] | AsyncIterator[str]:
        try:
            speculative = (await self._info(body.model)).speculative is not None  # usage then counts drafts
        except BaseException as e:
            raise _as_api_error(e) from None
        self._admit_stream()
        try:
            streams = await self._start(client, calls)
        except BaseException:
            self._release_stream()
            raise
        created, n = int(time.time()), body.n
        if body.stream:
            opts = body.stream_options
            usage = ("continuous" if opts and opts.continuous_usage_stats else
                     "final" if opts and opts.include_usage else None)
            return SSEStream(self._stream(streams, rid, obj + (".chunk" if chat else ""), created, body.model, n,
                                          chat, usage, tools, speculative), streams, self._release_stream)
        try:
            samples = [[_Sample() for _ in range(n)] for _ in streams]
            async for i, chunk in self._merge(streams):
                _accumulate(samples[i][chunk.index], chunk)
        finally:
            self._release_stream()
        choices = []
        for i, group in enumerate(samples):
            for j, s in enumerate(group):
                choice: dict[str, Any] = {"index": i * n + j, "finish_reason": s.finish_reason}
                if chat:
                    choice["message"] = {"role": "assistant", "content": s.text}
                    if tools is not None and s.finish_reason == "stop":
                        parser = ToolCallParser(tools)
                        content, calls = assemble(parser.feed(s.text) + parser.finish())
                        if calls:
                            choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                            choice["finish_reason"] = "tool_calls"
                    choice["logprobs"] = _chat_logprobs(s.logprobs) if s.logprobs is not None else None
                else:
                    choice["text"] = s.text
                    choice["logprobs"] = _completion_logprobs(s.logprobs) if s.logprobs is not None else None
                choices.append(choice)
        return {"id": rid, "object": obj, "created": created, "model": body.model, "choices": choices,
                "usage": _usage([info for _, info in streams], samples, speculative)}

    async def _stream(self, streams, rid, obj, created, model, n, chat, usage: str | None,
                      tools: ToolChoice | None = None, speculative: bool = False) -> AsyncIterator[str]:
        """`usage`: None, "final" (one last usage chunk) or "continuous" (usage so far on every chunk too).
        `tools`: how the chat's text turns into tool_calls deltas (None: it stays content)."""
        samples = [[_Sample() for _ in range(n)] for _ in streams]
        parsers = [[ToolCallParser(tools) for _ in range(n)] for _ in streams] if tools is not None else None
        infos = [info for _, info in streams]
        head = {"id": rid, "object": obj, "created": created, "model": model}
        try:
            if chat:
                for j in range(len(streams) * n):
                    yield sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            async for i, chunk in self._merge(streams):
                _accumulate(samples[i][chunk.index], chunk)
                if chunk.error:
                    yield sse(error_body(chunk.error, "server_error", code=500))
                    continue
                choice: dict[str, Any] = {"index": i * n + chunk.index, "finish_reason": chunk.finish_reason}
                if parsers is not None:
                    parser = parsers[i][chunk.index]
                    deltas = parser.feed(chunk.text) + (parser.finish() if chunk.finish_reason else [])
                    if chunk.finish_reason == "stop" and parser.num_calls:
                        choice["finish_reason"] = "tool_calls"
                    for delta in deltas[:-1]:
                        yield sse({**head, "choices": [{"index": choice["index"], "delta": delta, "logprobs": None,
                                                        "finish_reason": None}]})
                    if not deltas and not chunk.finish_reason and not chunk.logprobs:
                        continue  # text held back: a <tool_call> tag may be forming
                    choice["delta"] = deltas[-1] if deltas else {}
                    choice["logprobs"] = _chat_logprobs(chunk.logprobs) if chunk.logprobs else None
                elif chat:
                    choice["delta"] = {"content": chunk.text} if chunk.text else {}
                    choice["logprobs"] = _chat_logprobs(chunk.logprobs) if chunk.logprobs else None
                else:
                    choice["text"] = chunk.text
                    choice["logprobs"] = _completion_logprobs(chunk.logprobs) if chunk.logprobs else None
                event = {**head, "choices": [choice]}
                if usage == "continuous":
                    event["usage"] = _usage_so_far(infos, samples)
                yield sse(event)
            if usage is not None:
                yield sse({**head, "choices": [], "usage": _usage(infos, samples, speculative)})
        except ApiError as e:
            yield sse(e.body())
        yield sse("[DONE]")


class SSEStream:
    """The SSE body of one streaming response. Closing it, even before the first event, aborts
    the generation and gives back its concurrent-stream slot (exactly once)."""

    def __init__(self, events: AsyncIterator[str], engine_streams: list, release) -> None:
        self.events, self.engine_streams, self._release = events, engine_streams, release

    def __aiter__(self) -> SSEStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await self.events.__anext__()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        release, self._release = self._release, None
        if release is None:
            return
        await _close(self.events)
        for gen, _ in self.engine_streams:  # no-ops when the events already closed them
            await _close(gen)
        release()


# ---- request fields -> engine values (pure) ----------------------------------------------------------
def _structured(body) -> StructuredOutput | None:
    """response_format (OpenAI) or structured_outputs (vLLM) as one constraint; None for plain text."""
    so, rf = body.structured_outputs, body.response_format
    if so is not None and rf is not None and rf.type != "text":
        raise ApiError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    if so is not None and so.num_given != 1:
        raise ApiError(400, "give exactly one of json, regex, choice, grammar or json_object",
                       param="structured_outputs")
    if rf is not None and (rf.type == "json_schema") != (rf.json_schema is not None):
        raise ApiError(400, "json_schema is required with type json_schema, and only there", param="response_format")
    if so is not None:
        whitespace = so.disable_any_whitespace is False
        if so.json_ is not None:
            spec = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
            return StructuredOutput("json", spec, whitespace)
        if so.json_object:
            return StructuredOutput("json_object", "", whitespace)
        if so.regex is not None:
            return StructuredOutput("regex", so.regex)
        if so.choice is not None:
            return StructuredOutput("choice", json.dumps(so.choice))
        return StructuredOutput("grammar", so.grammar)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json_object", param="response_format")
    return StructuredOutput("json", json.dumps(rf.json_schema.schema_), label="json_schema", param="response_format")


def _template_input(messages) -> tuple[dict, ...]:
    for i, m in enumerate(messages):
        if (problem := m.problem()) is not None:
            raise ApiError(400, problem, param=f"messages.{i}")
    return tuple(m.as_template_input() for m in messages)


def _tool_choice(body, tools: list[dict] | None) -> ToolChoice | None:
    """OpenAI's default: auto with tools, none without; a named function must be one of `tools`."""
    choice, parallel = body.tool_choice, body.parallel_tool_calls is not False
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice is None or isinstance(choice, str):
        return ToolChoice(choice or "auto", parallel=parallel)
    names = [t["function"]["name"] for t in tools]
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                       f"({', '.join(names)})", param="tool_choice")
    return ToolChoice("named", choice.function.name, parallel)


# ---- formatting helpers (pure) -----------------------------------------------------------------
def _accumulate(s: _Sample, chunk: Chunk) -> None:
    s.text += chunk.text
    s.num_tokens_so_far += len(chunk.token_ids)
    if chunk.logprobs:
        s.logprobs = (s.logprobs or []) + list(chunk.logprobs)
    if chunk.finish_reason is not None:
        s.finish_reason = chunk.finish_reason
        s.num_cached_tokens, s.num_output_tokens = chunk.num_cached_tokens, chunk.num_output_tokens
        s.peak_kv_bytes = chunk.peak_kv_bytes
        s.num_draft_tokens, s.num_accepted_tokens = chunk.num_draft_tokens, chunk.num_accepted_tokens


def _usage(infos: list[PromptInfo], samples: list[list[_Sample]], speculative: bool = False) -> dict[str, Any]:
    """`speculative`: the model drafts tokens; its drafted / accepted counts join the usage (only then, so
    other models' usage keeps its shape)."""
    prompt = sum(i.num_prompt_tokens for i in infos)
    completion = sum(s.num_output_tokens for group in samples for s in group)
    cached = sum(group[0].num_cached_tokens for group in samples)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": cached},
             "kv_cache_bytes": sum(s.peak_kv_bytes for group in samples for s in group)}
    if speculative:
        usage["speculative"] = {"drafted": sum(s.num_draft_tokens for group in samples for s in group),
                                "accepted": sum(s.num_accepted_tokens for group in samples for s in group)}
    return usage


def _usage_so_far(infos: list[PromptInfo], samples: list[list[_Sample]]) -> dict[str, int]:
    prompt = sum(i.num_prompt_tokens for i in infos)
    completion = sum(s.num_tokens_so_far for group in samples for s in group)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(entries: list[LogprobEntry] | tuple[LogprobEntry, ...]) -> dict[str, Any]:
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: v for t, v, _ in e.top} for e in entries], "text_offset": offsets}


def _chat_logprobs(entries: list[LogprobEntry] | tuple[LogprobEntry, ...]) -> dict[str, Any]:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, v, b in e.top]}
                        for e in entries]}


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
