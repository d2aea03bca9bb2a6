"""One model behind the API: engine + tokenizer, speaking in prompts and text chunks.

No Ray here: the Serve deployment wraps a ModelWorker, and unit tests can use one directly.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any, AsyncIterator, Iterator, Sequence

from models.lora_format import AdapterError
from models.registry import resolve_model
from models.tokenizer import load_tokenizer
from server.engine.admission import check_token_ids, validate_embedding, validate_request
from server.engine.config import EngineConfig
from server.engine.core_client import EngineCoreClient
from server.engine.errors import InvalidRequestError, QueueFullError
from server.engine.grammar import check as check_grammar
from server.engine.pooling import EMBED_PARAMS, serves
from server.engine.sampling_params import Reasoning, SamplingParams
from server.metrics import MetricsRecorder
from server.reasoning import ANSWERING, END, START, answer_start, resolve
from server.template_kwargs import template_kwargs_problem
from server.tools import template_messages
from server.wire import (
    AttentionCall,
    AttentionMap,
    Chunk,
    EmbedCall,
    Embeddings,
    GenerateCall,
    LogprobEntry,
    LoraRef,
    MetricsSnapshot,
    ModelInfo,
    PromptInfo,
    PromptLogprob,
    RequestOutput,
    StepOutputs,
    TokenLogprob,
)


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()


async def _final_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """An embedding request's one output, read to the stream's end (a stream left early aborts)."""
    final = None
    async for out in stream:
        final = out
    if final is None or final.embedding is None:
        raise RuntimeError(f"embedding failed: {final.error if final is not None else 'no output'}")
    return final


def byte_level_bytes(piece: str) -> tuple[int, ...] | None:
    if not piece or any(c not in _BYTE_LEVEL for c in piece):
        return None
    return tuple(_BYTE_LEVEL[c] for c in piece)


def encode_prompt(tokenizer: Any, model: str, prompt: str | None = None, messages: Sequence[dict] | None = None,
                  add_special_tokens: bool = True, tools: Sequence[dict] | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A prompt's token ids: the text tokenized, or the messages (and tools, and `template_kwargs`, e.g.
    {"enable_thinking": False}) through the chat template."""
    if messages is not None:
        if not tokenizer.chat_template:
            raise InvalidRequestError(f"model {model!r} has no chat template", "messages")
        if template_kwargs and (problem := template_kwargs_problem(template_kwargs)) is not None:
            raise InvalidRequestError(f"chat_template_kwargs: {problem}", "chat_template_kwargs")
        messages, extra = template_messages(messages, tools, tokenizer.chat_template)
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True, **(template_kwargs or {}), **extra)["input_ids"]
        except Exception as e:  # noqa: BLE001 - templates raise what they like (jinja's TemplateError, ...)
            raise InvalidRequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        return list(ids)
    return list(tokenizer(prompt or "", add_special_tokens=add_special_tokens)["input_ids"])


class ModelWorker:
    """The replica's asyncio side: tokenizer, chat template, admission, logprob strings. The
    engine runs in its own process (`EngineCoreClient`)."""

    def __init__(self, name: str, config: EngineConfig) -> None:
        self.name = name
        self.tokenizer = load_tokenizer(resolve_model(config.model))
        self.metrics: MetricsRecorder | None = None
        self.engine = EngineCoreClient(config, on_outputs=self._account)
        # a reasoning model (server/reasoning.py): its parser, its tags as tokens, the server's budget
        self.reasoning_parser = resolve(config.reasoning_parser, getattr(self.tokenizer, "chat_template", None))
        self.tags = tuple(tuple(self.tokenizer.encode(t, add_special_tokens=False)) for t in (START, END))
        self.reasoning_budget = None if config.reasoning_budget < 0 else config.reasoning_budget
        self.info: ModelInfo = replace(self.engine.info, reasoning_parser=self.reasoning_parser)
        self.metrics = MetricsRecorder(name, self.info)
        # the LoRA adapters this worker loaded, least recently used first: the engine's own LRU as
        # this worker drives it (the engine evicts by itself when a load needs a slot)
        self.adapters: OrderedDict[str, LoraRef] = OrderedDict()
        self._loading: dict[str, asyncio.Future] = {}

    def _account(self, step: StepOutputs) -> None:
        if self.metrics is not None:
            for out in step.outputs:
                if out.finished and out.stats is not None:
                    self.metrics.on_finished(out.stats, out.finish_reason, out.request_id)

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_alive

    def inject_step_failures(self, count: int) -> None:
        """Make the next `count` model steps raise (chaos testing of the failure path)."""
        self.engine.inject_step_failures(count)

    def slow_steps(self, delay_s: float) -> None:
        """Sleep `delay_s` before every model step (chaos testing: in-flight requests stay in flight)."""
        self.engine.slow_steps(delay_s)

    def snapshot(self) -> MetricsSnapshot:
        """Metrics snapshot (cumulative counts + current gauges) for aggregation across replicas."""
        return self.metrics.snapshot(self.engine.stats)

    def stats(self) -> dict[str, int]:
        """The engine's latest stats value, as sent with its last outputs."""
        return {k: v for k, v in asdict(self.engine.stats).items() if k != "time"}

    async def load_adapter(self, ref: LoraRef) -> None:
        """Make a LoRA adapter resident on the engine now (its least recently used one may go), its
        load time recorded; AdapterError (a 4xx) when the engine cannot serve it."""
        if self.info.lora is None:
            raise AdapterError(f"model {self.name!r} has no LoRA slots: serve it with --max-loras N", 400, "model")
        answer = await self.engine.load_lora(ref)
        if answer.error is not None:
            raise AdapterError(answer.error, answer.status, "model")
        self.metrics.on_lora_load(answer.seconds)
        self.adapters[ref.name] = ref
        self.adapters.move_to_end(ref.name)
        while len(self.adapters) > self.info.lora.max_loras:
            self.adapters.popitem(last=False)

    async def unload_adapter(self, name: str) -> None:
        """Free an adapter's slot once its requests in flight finish (the engine drains it)."""
        self.adapters.pop(name, None)
        await self.engine.unload_lora(name)

    async def _use_adapter(self, ref: LoraRef) -> None:
        """Before a request on `ref`: load it unless this worker holds it (one load for concurrent requests)."""
        if self.adapters.get(ref.name) == ref:
            self.adapters.move_to_end(ref.name)
            return
        load = self._loading.get(ref.name)
        if load is None:
            load = self._loading[ref.name] = asyncio.ensure_future(self.load_adapter(ref))
            load.add_done_callback(lambda _: self._loading.pop(ref.name, None))
        await asyncio.shield(load)  # NOTE: a request that goes away leaves the load to finish for the others

    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
               add_special_tokens: bool = True, tools: Sequence[dict] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, self.name, prompt, messages, add_special_tokens, tools, template_kwargs)

    def decode(self, token_ids: Sequence[int]) -> str:
        check_token_ids(self.info, token_ids, "tokens")
        return self.tokenizer.decode(list(token_ids))

    def _token_str(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """A token's text and bytes; a piece of a UTF-8 character shows as `bytes:\\xNN` (as OpenAI does)."""
        text = self.tokenizer.decode([token_id])
        if "\ufffd" not in text:
            return text, tuple(text.encode("utf-8"))
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        raw = byte_level_bytes(piece)
        if raw is None:
            return piece, tuple(text.encode("utf-8"))
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _logprobs(self, items: Sequence[TokenLogprob]) -> tuple[LogprobEntry, ...]:
        out = []
        for lp in items:
            text, raw = self._token_str(lp.token_id)
            top = tuple((s, v, b) for t, v in lp.top for s, b in [self._token_str(t)])
            out.append(LogprobEntry(text, lp.logprob, raw, top))
        return tuple(out)

    async def generate(self, call: GenerateCall) -> AsyncIterator[PromptInfo | Chunk]:
        """PromptInfo, then Chunks until every sample has finished. Bad input raises
        InvalidRequestError before anything is yielded; closing the stream aborts."""
        if not serves(self.info.task, "generate"):
            self.metrics.on_error("invalid_request")
            raise InvalidRequestError(f"model {self.name!r} serves embeddings (task embed), not text generation: "
                                      "use /v1/embeddings", "model")
        if call.lora is not None:
            with self._counting_refusals():
                await self._use_adapter(call.lora)
        if call.prompt_token_ids is not None:
            ids = list(call.prompt_token_ids)
        else:
            ids = encode_prompt(self.tokenizer, self.name, call.prompt, call.messages, tools=call.tools,
                                template_kwargs=call.chat_template_kwargs)
        start = None
        if call.chat and self.reasoning_parser is not None:
            start = answer_start(self.reasoning_parser, self.tokenizer.decode(ids[-8:]))
        params = self._thinking(call.params, start)
        if call.fit_max_tokens:
            params = replace(params, max_tokens=max(1, min(params.max_tokens, self.info.max_model_len - len(ids))))
        with self._counting_refusals():
            validate_request(self.info, ids, params)  # NOTE: the one validation of a request
            if params.structured is not None:  # off the event loop: a large schema takes a while
                await asyncio.to_thread(check_grammar, params.structured)
            stream = self.engine.generate(ids, params, call.request_id, coalesce=True, final_only=not call.stream,
                                          lora=call.lora)
        yield PromptInfo(len(ids), start, self.tokenizer.decode(ids) if call.echo else None)
        # a non-streaming caller gets each sample once, whole (final_only): one message per
        # sample from the engine and to the ingress, not one per token
        scored: tuple[PromptLogprob, ...] | None = None  # the samples' prompt logprobs, as text once
        async for out in stream:
            if out.prompt_logprobs is not None and scored is None:
                scored = self._prompt_logprobs(ids, out.prompt_logprobs)
            yield self._chunk(out, scored if out.prompt_logprobs is not None else None)

    @contextmanager
    def _counting_refusals(self) -> Iterator[None]:
        """A request refused before it reaches the engine counts in the error metrics, by why."""
        try:
            yield
        except (InvalidRequestError, AdapterError):
            self.metrics.on_error("invalid_request")
            raise
        except QueueFullError:
            self.metrics.on_error("queue_full")
            raise

    def _thinking(self, params: SamplingParams, start: str | None) -> SamplingParams:
        """The engine follows a thinking where it can matter: with a budget (the request's, else the
        server's) or a grammar, which then applies after the thinking; else the answer is left as it is."""
        budget = params.thinking_budget if params.thinking_budget is not None else self.reasoning_budget
        if start is None or start == ANSWERING or (budget is None and params.structured is None):
            return params
        return replace(params, reasoning=Reasoning(self.tags[0], self.tags[1], start, budget))

    async def attention(self, call: AttentionCall) -> AttentionMap:
        """The prompt's attention weights per layer; InvalidRequestError for a prompt over
        `call.max_tokens` or a layer the model does not have."""
        if call.prompt_token_ids is not None:
            ids = list(call.prompt_token_ids)
        else:
            ids = self.encode(call.prompt, call.messages)
        check_token_ids(self.info, ids, "prompt")
        if len(ids) > call.max_tokens:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; attention maps take at most "
                                      f"{call.max_tokens}", "prompt")
        answer = await self.engine.attention(ids, call.layers)
        if answer.error is not None:
            raise InvalidRequestError(answer.error, "layers")
        tokens = tuple(self._token_str(t)[0] for t in ids)
        return AttentionMap(tokens, tuple(ids), tuple((i, w.tolist()) for i, w in answer.layers),
                            windows=answer.windows, sinks=answer.sinks)

    async def embed(self, call: EmbedCall) -> Embeddings:
        """Every input's embedding: all validated first (bad input is an InvalidRequestError, nothing queued),
        then all in the engine at once, so that their prefills share steps (with generation too); if one
        fails, the others are aborted (their KV blocks freed)."""
        if not serves(self.info.task, "embed"):
            self.metrics.on_error("invalid_request")
            raise InvalidRequestError(f"model {self.name!r} serves text generation, not embeddings: serve an "
                                      "embedding model (--task embed, or generate,embed)", "model")
        prompts = [list(x) if isinstance(x, tuple) else encode_prompt(self.tokenizer, self.name, x)
                   for x in call.inputs]
        with self._counting_refusals():
            for ids in prompts:
                validate_embedding(self.info, ids)  # NOTE: the one validation of an embedding input
            streams = [self.engine.generate(ids, EMBED_PARAMS, f"{call.request_id}-{i}", final_only=True, embed=True)
                       for i, ids in enumerate(prompts)]
        try:
            async with asyncio.TaskGroup() as group:  # NOTE: one failing cancels the rest, which closes (aborts) them
                finals = [group.create_task(_final_output(stream)) for stream in streams]
        except ExceptionGroup as e:  # the first failure, as a lone input's would be
            raise e.exceptions[0] from None
        return Embeddings(tuple(f.result().embedding for f in finals), sum(map(len, prompts)))

    def _prompt_logprobs(self, ids: Sequence[int], values: Sequence[TokenLogprob]) -> tuple[PromptLogprob, ...]:
        """Every prompt token with its text: the first has no logprob; the others the engine's (`values`)."""
        first = PromptLogprob(ids[0], self._token_str(ids[0])[0], None, None, None)
        return (first, *(PromptLogprob(v.token_id, self._token_str(v.token_id)[0], v.logprob, v.rank,
                                       tuple((t, self._token_str(t)[0], lp) for t, lp in v.top)) for v in values))

    def _chunk(self, out: RequestOutput, prompt_logprobs: tuple[PromptLogprob, ...] | None = None) -> Chunk:
        s = out.stats
        return Chunk(
            index=out.index, text=out.new_text, token_ids=out.new_token_ids,
            logprobs=self._logprobs(out.new_logprobs) if out.new_logprobs else (),
            finish_reason=out.finish_reason,
            num_cached_tokens=s.num_cached_tokens if s else 0,
            num_output_tokens=s.num_output_tokens if s else 0,
            peak_kv_bytes=s.peak_kv_bytes if s else 0,
            num_draft_tokens=s.num_draft_tokens if s else 0,
            num_accepted_tokens=s.num_accepted_tokens if s else 0,
            error=out.error,
            stop_reason=out.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def shutdown(self) -> None:
        self.engine.shutdown()
