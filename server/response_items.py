"""A response's output items as they form. One `OutputItems` per response is fed the answer's
pieces (reasoning text, answer text, tool-call pieces) from streamed chat deltas, or from a whole
chat message at once; each feed returns the Responses stream events it makes (without sequence
numbers) and `items` is the final output, so streamed and whole responses are built the same way."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    index: int  # output_index
    text: str = ""  # the reasoning or answer text, or a call's arguments
    call_id: str = ""
    name: str = ""
    chat_index: int | None = None  # a call's index among the chat answer's tool_calls

    def as_dict(self, status: str) -> dict[str, Any]:
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                    "arguments": self.text, "status": status}
        parts = [self.part()] if status != "in_progress" else []
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": parts, "status": status}
        return {"id": self.id, "type": "message", "role": "assistant", "status": status, "content": parts}

    def part(self, text: str | None = None) -> dict[str, Any]:
        text = self.text if text is None else text
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputItems:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # the finished ones
        self._open: _Item | None = None
        # NOTE: whitespace before any answer text is held back: a message item opens only for text
        # that shows, so an answer that is only tool calls (after a newline, say) has no empty message
        self._pending = ""

    def reasoning(self, text: str) -> list[Event]:
        if not text:
            return []
        events = [] if self._is_open("reasoning") else self._close() + self._start("reasoning")
        return events + [self._delta("response.reasoning_text.delta", text)]

    def text(self, text: str) -> list[Event]:
        if not text:
            return []
        if not self._is_open("message"):
            if not (self._pending + text).strip():
                self._pending += text
                return []
            text, self._pending = self._pending + text, ""
            events = self._close() + self._start("message")
        else:
            events = []
        return events + [self._delta("response.output_text.delta", text)]

    def call(self, chat_index: int, call_id: str | None, name: str | None, arguments: str) -> list[Event]:
        """A tool call's piece: the first names it (`call_id`, `name`), later ones add arguments."""
        events = []
        if not (self._is_open("function_call") and self._open.chat_index == chat_index):
            events = self._close() + self._start("function_call", call_id=call_id or new_id("call"), name=name or "",
                                                 chat_index=chat_index)
        if arguments:
            events.append(self._delta("response.function_call_arguments.delta", arguments))
        return events

    def finish(self, status: str) -> list[Event]:
        """`status`: the open item's, "completed" or "incomplete" (cut short). An answer with no item
        at all still gets its (empty) message."""
        events = [] if self.items or self._open else self._start("message")
        return events + self._close(status)

    # ---- events ---------------------------------------------------------------------------
    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open.kind == kind

    def _start(self, kind: str, **fields: Any) -> list[Event]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = self._open = _Item(kind, new_id(prefix), len(self.items), **fields)
        events = [{"type": "response.output_item.added", "output_index": item.index, "item": item.as_dict("in_progress")}]
        if kind != "function_call":
            events.append({"type": "response.content_part.added", **_where(item), "part": item.part("")})
        return events

    def _delta(self, type_: str, text: str) -> Event:
        item = self._open
        item.text += text
        event = {"type": type_, **_where(item, part=item.kind != "function_call"), "delta": text}
        if type_ == "response.output_text.delta":
            event["logprobs"] = []
        return event

    def _close(self, status: str = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        if item.kind == "function_call":
            events = [{"type": "response.function_call_arguments.done", **_where(item, part=False),
                       "arguments": item.text}]
        else:
            done = {"type": f"response.{'reasoning' if item.kind == 'reasoning' else 'output'}_text.done",
                    **_where(item), "text": item.text}
            if item.kind == "message":
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", **_where(item), "part": item.part()}]
        whole = item.as_dict(status)
        self.items.append(whole)
        return events + [{"type": "response.output_item.done", "output_index": item.index, "item": whole}]


def _where(item: _Item, part: bool = True) -> dict[str, Any]:
    """Which item an event is about (and its one content part)."""
    return {"item_id": item.id, "output_index": item.index, **({"content_index": 0} if part else {})}
