"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over OpenAIApi's chat.

A translation layer: a Messages body becomes a `ChatCompletionRequest`, and the chat answer's streamed
chunks become Anthropic's events. The non-streamed answer is the same events accumulated by the same
`MessageBuilder`, so streamed and whole answers cannot disagree (text, blocks, stop reason, usage).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from server.api_request import validated
from server.event_stream import EventStream, EventStreamResponse, named_sse
from server.messages_protocol import (
    MESSAGES_PATH,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from server.openai_api import ApiError, OpenAIApi, SSEStream
from server.protocol import ChatCompletionRequest, TokenizeRequest

FINISH_TO_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: a user turn's tool_result blocks become `tool` messages (in
    place, around its text), an assistant turn's tool_use blocks its `tool_calls`; thinking is dropped."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": body.system if isinstance(body.system, str) else
                    "\n".join(b.text for b in body.system)})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        wrong, name = (ToolResultBlock, "tool_result") if m.role == "assistant" else (ToolUseBlock, "tool_use")
        if any(isinstance(b, wrong) for b in m.content):
            raise ApiError(400, f"{name} blocks cannot be in a {m.role} message", param=f"messages.{i}.content")
        if m.role == "assistant":
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls} if calls else
                       {"role": "assistant", "content": text})
            continue
        texts: list[str] = []
        emitted = False
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                if texts:
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
                emitted = True
            elif isinstance(b, TextBlock):
                texts.append(b.text)
        if texts or not emitted:
            out.append({"role": "user", "content": "".join(texts)})
    if body.messages[-1].role == "assistant":
        raise ApiError(400, "the last message must be a user message: continuing an assistant message "
                       "(prefill) is not supported", param=f"messages.{len(body.messages) - 1}.role")
    return out


def chat_tools(body: CountTokensRequest) -> dict[str, Any]:
    """tools and tool_choice as chat fields: auto -> auto, any -> required, tool -> named, none -> none."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and not isinstance(choice, ToolChoiceNone):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return {}
    fields: dict[str, Any] = {"tools": [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in body.tools]}
    if choice is None:
        return fields
    fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if isinstance(choice, ToolChoiceTool)
                             else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
    if getattr(choice, "disable_parallel_tool_use", None):
        fields["parallel_tool_calls"] = False
    return fields


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat body this Messages body asks for, always streamed (with its usage at the end)."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body), "max_tokens": body.max_tokens,
                              "stream": True, "stream_options": {"include_usage": True}, **chat_tools(body)}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    if body.metadata is not None and body.metadata.user_id is not None:
        fields["user"] = body.metadata.user_id
    if isinstance(body.thinking, ThinkingEnabled):
        fields["thinking_token_budget"] = body.thinking.budget_tokens
    fields["chat_template_kwargs"] = _template_kwargs(body)
    config = body.output_config
    if config is not None and config.effort is not None:
        fields["reasoning_effort"] = config.effort
    if config is not None and config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                            "schema": config.format.schema_}}
    return validated(ChatCompletionRequest, fields)


def _template_kwargs(body: CountTokensRequest) -> dict[str, Any] | None:
    return {"enable_thinking": False} if isinstance(body.thinking, ThinkingDisabled) else None


class MessageBuilder:
    """One answer as Anthropic's stream events, from chat chunks (`add`), and as the whole message.

    Content blocks open in the order their deltas come (thinking, text, tool_use); a delta of another
    kind, or another tool call, closes the open block."""

    def __init__(self, model: str, input_tokens: int) -> None:
        self.id, self.model = f"msg_{uuid.uuid4().hex}", model
        self.blocks: list[dict[str, Any]] = []
        self.tool_args: dict[int, str] = {}  # block index -> its tool input's JSON text so far
        self.tool_blocks: dict[int, int] = {}  # chat tool-call index -> block index
        self.open: int | None = None  # the block being written
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": input_tokens, "output_tokens": 0}
        self.error: dict[str, Any] | None = None  # a failed generation's error event

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {**self._head(), "content": [], "stop_reason": None,
                                                      "stop_sequence": None, "usage": dict(self.usage)}}]

    def add(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat chunk (or its `{"error": ...}` body) -> the events it makes."""
        if "error" in chunk:
            self.error = {"type": "error", "error": {"type": "api_error", "message": chunk["error"]["message"]}}
            return [self.error]
        if chunk.get("usage") is not None:
            self.usage = {"input_tokens": chunk["usage"]["prompt_tokens"],
                          "output_tokens": chunk["usage"]["completion_tokens"]}
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._write("thinking", "thinking_delta", "thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self._write("text", "text_delta", "text", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                stop = choice.get("stop_reason")  # the stop string matched, where the engine says so
                self.stop_sequence = stop if isinstance(stop, str) and choice["finish_reason"] == "stop" else None
                self.stop_reason = ("stop_sequence" if self.stop_sequence is not None else
                                    FINISH_TO_STOP.get(choice["finish_reason"], "end_turn"))
        return events

    def finish(self) -> list[dict[str, Any]]:
        return [*self._close(), {"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                                    "stop_sequence": self.stop_sequence},
                                 "usage": {"output_tokens": self.usage["output_tokens"]}},
                {"type": "message_stop"}]

    def message(self) -> dict[str, Any]:
        content = [{**b, "input": _tool_input(self.tool_args[i])} if b["type"] == "tool_use" else b
                   for i, b in enumerate(self.blocks)]
        return {**self._head(), "content": content, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": dict(self.usage)}

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _close(self) -> list[dict[str, Any]]:
        index, self.open = self.open, None
        return [] if index is None else [{"type": "content_block_stop", "index": index}]

    def _begin(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.open = len(self.blocks)
        self.blocks.append(block)
        return events + [{"type": "content_block_start", "index": self.open, "content_block": dict(block)}]

    def _write(self, kind: str, delta_type: str, field: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.blocks[self.open]["type"] != kind:
            events = self._begin({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                 else {"type": "text", "text": ""})
        self.blocks[self.open][field] += text
        return events + [{"type": "content_block_delta", "index": self.open, "delta": {"type": delta_type,
                                                                                       field: text}}]

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if call["index"] not in self.tool_blocks:
            events = self._begin({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                  "name": call["function"]["name"], "input": {}})
            self.tool_blocks[call["index"]] = self.open
            self.tool_args[self.open] = ""
        index = self.tool_blocks[call["index"]]
        args = call["function"].get("arguments") or ""
        if args:
            self.tool_args[index] += args
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": args}})
        return events


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's input object; {} where its JSON is empty or cut short (max_tokens)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def _events(stream: SSEStream, builder: MessageBuilder) -> AsyncIterator[str]:
    for event in builder.start():
        yield named_sse(event)
    async for chunk in stream:
        for event in builder.add(chunk):
            yield named_sse(event)
        if builder.error is not None:
            return
    for event in builder.finish():
        yield named_sse(event)


async def _whole(stream: SSEStream, builder: MessageBuilder) -> dict[str, Any]:
    try:
        async for chunk in stream:
            builder.add(chunk)
            if builder.error is not None:
                code = chunk["error"].get("code")
                raise ApiError(code if isinstance(code, int) else 503, chunk["error"]["message"], "server_error")
    finally:
        await stream.aclose()
    builder.finish()
    return builder.message()


def add_messages_routes(app: FastAPI, api: OpenAIApi) -> None:
    """Errors under these paths take Anthropic's shape (server/http_app.py's handlers and middleware)."""

    @app.post(MESSAGES_PATH)
    async def messages(body: MessagesRequest):
        stream = await api.chat(chat_request(body), raw=True)
        # NOTE: from here on the chat stream holds the request (and its KV blocks): every path closes it
        builder = MessageBuilder(body.model, sum(info.num_prompt_tokens for _, info in stream.engine_streams))
        if body.stream:
            return EventStreamResponse(EventStream(_events(stream, builder), stream))
        return JSONResponse(await _whole(stream, builder))

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> JSONResponse:
        tools = chat_tools(body)
        calling = tools.get("tools") and tools.get("tool_choice") != "none"
        request = validated(TokenizeRequest, {"model": body.model, "messages": chat_messages(body),
                                               "tools": tools["tools"] if calling else None,
                                               "chat_template_kwargs": _template_kwargs(body)})
        return JSONResponse({"input_tokens": (await api.tokenize(request))["count"]})

