"""A ModelClient over a ModelWorker in the same process: a one-model replica serving HTTP itself,
and unit tests of the API layer."""
from __future__ import annotations

from typing import AsyncIterator

from server.wire import AttentionCall, AttentionMap, Chunk, GenerateCall, ModelInfo, PromptInfo
from server.worker import ModelWorker


class LocalModelClient:
    def __init__(self, worker: ModelWorker) -> None:
        self.worker = worker

    async def info(self) -> ModelInfo:
        return self.worker.info

    async def health(self) -> bool:
        return self.worker.is_healthy

    def generate(self, call: GenerateCall) -> AsyncIterator[PromptInfo | Chunk]:
        return self.worker.generate(call)

    async def encode(self, prompt, messages, add_special_tokens: bool) -> list[int]:
        return self.worker.encode(prompt, messages, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return self.worker.decode(token_ids)

    async def attention(self, call: AttentionCall) -> AttentionMap:
        return await self.worker.attention(call)
