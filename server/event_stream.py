"""Server-sent events whose stream holds an engine request: closing the response closes the stream
(which aborts the request and frees its KV blocks) however it ends: done, failed, the client gone,
or cancelled before its first event."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def named_sse(event: dict[str, Any]) -> str:
    """An event with an `event:` line naming its type (the Responses and Messages APIs' framing)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class EventStream:
    """`events` made from `held`, a stream that holds an engine request. NOTE: an async generator never
    started runs no `finally`: closing this closes `held` itself."""

    def __init__(self, events: AsyncIterator[str], held: Any) -> None:
        self.events, self.held = events, held

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> str:
        return await self.events.__anext__()

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
        finally:
            await self.held.aclose()


class EventStreamResponse(StreamingResponse):
    """The SSE answer over a stream with `aclose` (an `EventStream`, or the chat API's `SSEStream`)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.aclose()
