"""One model behind the API: engine + tokenizer, speaking in prompts and text chunks.

No Ray here: the Serve deployment wraps a ModelWorker, and unit tests can use one directly.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Sequence

from server.engine import EngineConfig, LLMEngine, QueueFullError, SamplingParams
from server.engine.async_engine import AsyncEngine
from server.engine.errors import InvalidRequestError
from server.engine.request import RequestOutput, TokenLogprob
from server.metrics import MetricsRecorder


@dataclass(frozen=True)
class ModelInfo:
    """What the API layer needs to know of a model (/v1/models, context checks)."""

    max_model_len: int
    attention: str  # mha | gqa | mqa
    num_kv_heads: int
    kv_bytes_per_token: int


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...]


@dataclass(frozen=True)
class GenerateCall:
    """One prompt (text, token ids, or chat messages) and how to sample it."""

    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    fit_max_tokens: bool = False  # max_tokens not given: use what the context leaves (capped by params)


@dataclass(frozen=True)
class PromptInfo:
    """First item of every generation stream."""

    num_prompt_tokens: int


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
    error: str | None = None


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


def byte_level_bytes(piece: str) -> tuple[int, ...] | None:
    if not piece or any(c not in _BYTE_LEVEL for c in piece):
        return None
    return tuple(_BYTE_LEVEL[c] for c in piece)


class ModelWorker:
    def __init__(self, name: str, config: EngineConfig) -> None:
        self.name = name
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        cfg = self.engine.model_config
        self.metrics = MetricsRecorder(name, cfg.attention_kind, cfg.num_kv_heads, self.engine.max_model_len,
                                       self.engine.kv.num_blocks)
        self.engine.on_finished = self.metrics.on_finished
        self.async_engine = AsyncEngine(self.engine, config.num_threads)
        self.info = ModelInfo(self.engine.max_model_len, cfg.attention_kind, cfg.num_kv_heads,
                              self.engine.kv_spec.bytes_per_token)

    @property
    def is_healthy(self) -> bool:
        return self.async_engine.is_alive

    def inject_step_failures(self, count: int) -> None:
        """Make the next `count` model steps raise (chaos testing of the failure path)."""
        runner, real = self.engine.runner, self.engine.runner.execute
        remaining = [count]

        def failing(batch):
            if remaining[0] > 0:
                remaining[0] -= 1
                raise RuntimeError("injected model step failure")
            return real(batch)
        runner.execute = failing

    def snapshot(self) -> dict[str, Any]:
        """Metrics snapshot (cumulative counts + current gauges) for aggregation across replicas."""
        return self.metrics.snapshot(self.engine)

    def stats(self) -> dict[str, int]:
        """A racy but consistent-enough snapshot of engine state (read from the API thread)."""
        e, sch = self.engine, self.engine.scheduler
        return {
            "num_blocks": e.kv.num_blocks, "num_used_blocks": e.kv.num_used_blocks,
            "num_running": len(sch.running), "num_waiting": len(sch.waiting),
            "num_unfinished_groups": len(e.groups), "num_preemptions": sch.num_preemptions,
            "num_steps": e.num_steps, "num_step_errors": e.num_step_errors,
        }

    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
               add_special_tokens: bool = True) -> list[int]:
        if messages is not None:
            if not self.tokenizer.chat_template:
                raise InvalidRequestError(f"model {self.name!r} has no chat template", "messages")
            ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
            return list(ids)
        return list(self.tokenizer(prompt or "", add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        vocab = self.engine.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab})", "tokens")
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
        if call.prompt_token_ids is not None:
            ids = list(call.prompt_token_ids)
        else:
            ids = self.encode(call.prompt, call.messages)
        params = call.params
        if call.fit_max_tokens:
            params = replace(params, max_tokens=max(1, min(params.max_tokens, self.info.max_model_len - len(ids))))
        try:
            stream = self.async_engine.generate(ids, params, call.request_id, coalesce=True)
        except InvalidRequestError:
            self.metrics.on_error("invalid_request")
            raise
        except QueueFullError:
            self.metrics.on_error("queue_full")
            raise
        yield PromptInfo(len(ids))
        try:
            async for out in stream:
                yield self._chunk(out)
        except QueueFullError:
            self.metrics.on_error("queue_full")
            raise

    def _chunk(self, out: RequestOutput) -> Chunk:
        s = out.stats
        return Chunk(
            index=out.index, text=out.new_text, token_ids=out.new_token_ids,
            logprobs=self._logprobs(out.new_logprobs) if out.new_logprobs else (),
            finish_reason=out.finish_reason,
            num_cached_tokens=s.num_cached_tokens if s else 0,
            num_output_tokens=s.num_output_tokens if s else 0,
            peak_kv_bytes=s.peak_kv_bytes if s else 0,
            error=out.error,
        )

    def shutdown(self) -> None:
        self.async_engine.shutdown()
