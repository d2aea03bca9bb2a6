"""The one interface the API layer calls on a model, and its local implementation.

`LocalModelClient` runs the calls on a `ModelWorker` in this process: a one-model replica serving
HTTP itself, the Serve replica behind a `RayModelClient` (server/deployment.py: `ModelReplica` is a
local client, so a Ray call lands on these same methods), and unit tests of the API layer.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from contextlib import aclosing
from typing import TYPE_CHECKING, AsyncIterator

from server.wire import AttentionCall, AttentionMap, Chunk, EmbedCall, Embeddings, GenerateCall, ModelInfo, PromptInfo

if TYPE_CHECKING:  # NOTE: the API layer imports this module, and no torch
    from server.worker import ModelWorker


class ModelClient(ABC):
    @abstractmethod
    async def info(self) -> ModelInfo: ...

    @abstractmethod
    async def health(self) -> bool: ...

    @abstractmethod
    def generate(self, call: GenerateCall) -> AsyncIterator[PromptInfo | Chunk]:
        """The prompt's `PromptInfo` (bad input fails before it), then its chunks; closing the stream
        aborts the request, which frees its KV blocks."""

    @abstractmethod
    async def embed(self, call: EmbedCall) -> Embeddings:
        """Every input's embedding (an embedding model's: `ModelInfo.task` embed); bad input fails first."""

    @abstractmethod
    async def encode(self, prompt: str | None, messages: list[dict] | None, add_special_tokens: bool,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The prompt's token ids; messages go through the chat template (with `tools` and `template_kwargs`)."""

    @abstractmethod
    async def decode(self, token_ids: list[int]) -> str: ...

    @abstractmethod
    async def attention(self, call: AttentionCall) -> AttentionMap: ...

    async def unload_adapter(self, name: str) -> None:
        """Free a LoRA adapter's slot where this client's requests run (requests in flight on it finish).
        Here nothing: replicas behind a router drop an unregistered adapter by LRU as others come."""

    # ---- chaos testing: refused unless ATTNSERVE_CHAOS=1 where the engine runs --------------------
    @abstractmethod
    async def inject_step_failures(self, count: int) -> None:
        """The next `count` model steps raise."""

    @abstractmethod
    async def slow_steps(self, delay_s: float) -> None:
        """Sleep `delay_s` before every model step (in-flight requests stay in flight)."""


def check_chaos() -> None:
    if os.environ.get("ATTNSERVE_CHAOS") != "1":
        raise PermissionError("fault injection is disabled (set ATTNSERVE_CHAOS=1 on the replicas)")


class LocalModelClient(ModelClient):
    def __init__(self, worker: ModelWorker) -> None:
        self.worker = worker

    async def info(self) -> ModelInfo:
        return self.worker.info

    async def health(self) -> bool:
        return self.worker.is_healthy

    async def generate(self, call: GenerateCall) -> AsyncIterator[PromptInfo | Chunk]:
        # NOTE: an async generator of its own (Serve streams this method, and cancels it when the caller
        # goes away); closing it closes the worker's stream at once, which aborts the request
        async with aclosing(self.worker.generate(call)) as stream:
            async for item in stream:
                yield item

    async def embed(self, call: EmbedCall) -> Embeddings:
        return await self.worker.embed(call)

    async def encode(self, prompt: str | None, messages: list[dict] | None, add_special_tokens: bool,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        return self.worker.encode(prompt, messages, add_special_tokens, tools, template_kwargs)

    async def decode(self, token_ids: list[int]) -> str:
        return self.worker.decode(token_ids)

    async def attention(self, call: AttentionCall) -> AttentionMap:
        return await self.worker.attention(call)

    async def unload_adapter(self, name: str) -> None:
        await self.worker.unload_adapter(name)

    async def inject_step_failures(self, count: int) -> None:
        check_chaos()
        self.worker.inject_step_failures(count)

    async def slow_steps(self, delay_s: float) -> None:
        check_chaos()
        self.worker.slow_steps(delay_s)
