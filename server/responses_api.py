"""The OpenAI Responses API (`/v1/responses`) over OpenAIApi's chat: a Responses body becomes a chat
body (its input items, and a stored earlier response's, as messages), the chat answer or its
streamed chunks become the response or its events (server/response_items.py), and a response
asked to be stored goes to the store every replica reads (server/response_store.py)."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from server.api_request import ApiError, validated
from server.event_stream import EventStream, EventStreamResponse, named_sse
from server.openai_api import OpenAIApi
from server.protocol import ChatCompletionRequest
from server.response_items import OutputItems, new_id
from server.response_store import LocalStore, ResponseStore, StoreClient, StoreConfig
from server.responses_protocol import ResponsesRequest

# chat fields named in errors -> the Responses field the client sent
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
           "prompt": "input", "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def add_responses_routes(app: FastAPI, api: OpenAIApi, store: StoreClient | None = None) -> None:
    """`store`: where stored responses go; None: a store in this process (one replica)."""
    responses = ResponsesApi(api, store or LocalStore(ResponseStore(StoreConfig())))

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest):
        result = await responses.create(body)
        return JSONResponse(result) if isinstance(result, dict) else EventStreamResponse(result)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse((await responses.stored(response_id, "response_id"))["response"])

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        if not await responses.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


class ResponsesApi:
    """Responses over `api`'s chat, stored in `store` (this process's, or the application's actor)."""

    def __init__(self, api: OpenAIApi, store: StoreClient) -> None:
        self.api, self.store = api, store

    async def stored(self, response_id: str, param: str) -> dict[str, Any]:
        record = await self.store.get(response_id)
        if record is None:
            raise _not_found(response_id, param)
        return record

    async def create(self, req: ResponsesRequest) -> dict[str, Any] | EventStream:
        """The response, or its stream's SSE events. Bad input raises ApiError before any engine work."""
        history = (await self.stored(req.previous_response_id, "previous_response_id"))["context"] \
            if req.previous_response_id else []
        context = history + req.input_items()  # what a later previous_response_id continues
        body = chat_body(req, context)
        try:
            answer = await self.api.chat(body, raw=True) if req.stream else await self.api.chat(body)
        except ApiError as e:
            raise _renamed(e) from None
        head = _head(req, new_id("resp"))
        if req.stream:
            return EventStream(self._events(answer, head, req, context), answer)
        choice = answer["choices"][0]
        items, message = OutputItems(), choice["message"]
        items.reasoning(message.get("reasoning_content") or "")
        items.text(message.get("content") or "")
        for i, call in enumerate(message.get("tool_calls") or ()):
            items.call(i, call["id"], call["function"]["name"], call["function"]["arguments"])
        items.finish(_item_status(choice["finish_reason"]))
        response = _finished(head, items, choice["finish_reason"], answer["usage"], None)
        await self._keep(req, response, context)
        return response

    async def _events(self, chunks: AsyncIterator, head: dict[str, Any], req: ResponsesRequest,
                      context: list[dict[str, Any]]) -> AsyncIterator[str]:
        """The chat stream's chunks as Responses events. NOTE: `chunks` is closed on every way out
        (a client gone away included), which aborts the generation and frees its KV blocks."""
        items, seq = OutputItems(), 0

        def sse(event: dict[str, Any]) -> str:
            nonlocal seq
            event["sequence_number"], seq = seq, seq + 1
            return named_sse(event)
        try:
            started = {**head, "status": "in_progress"}
            yield sse({"type": "response.created", "response": started})
            yield sse({"type": "response.in_progress", "response": started})
            finish, usage, error = None, None, None
            async for chunk in chunks:
                if "error" in chunk:  # the engine failed: what it made so far, then response.failed
                    finish, error = "error", chunk["error"].get("message")
                    break
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    events = items.reasoning(delta.get("reasoning_content") or "") + items.text(delta.get("content") or "")
                    for call in delta.get("tool_calls") or ():
                        function = call.get("function", {})
                        events += items.call(call["index"], call.get("id"), function.get("name"),
                                             function.get("arguments", ""))
                    finish = choice.get("finish_reason") or finish
                    for event in events:
                        yield sse(event)
            for event in items.finish(_item_status(finish)):
                yield sse(event)
            response = _finished(head, items, finish, usage, error)
            await self._keep(req, response, context)
            yield sse({"type": f"response.{response['status']}", "response": response})
        finally:
            await chunks.aclose()

    async def _keep(self, req: ResponsesRequest, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        """Stores a finished response (unless `store: false`): itself for GET, and the conversation so
        far (instructions aside: each request gives its own) for a later previous_response_id."""
        if req.store:
            await self.store.put(response["id"], {"response": response, "context": context + response["output"]})


def chat_body(req: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request is; `items`: the conversation's input items, oldest first."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + \
        chat_messages(items)
    fmt = req.text.format if req.text is not None else None
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "user": req.user, "priority": req.priority,
        "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in req.tools] if req.tools else None,
        "tool_choice": ({"type": "function", "function": {"name": req.tool_choice.name}}
                        if req.tool_choice is not None and not isinstance(req.tool_choice, str) else req.tool_choice),
        "response_format": None if fmt is None or fmt.type == "text" else
        {"type": "json_object"} if fmt.type == "json_object" else
        {"type": "json_schema", "json_schema": fmt.model_dump(exclude={"type"}, by_alias=True, exclude_none=True)},
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return validated(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})
    except ApiError as e:
        raise _renamed(e) from None


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input and output items -> chat messages: a function_call joins the assistant message before it
    (or makes one), its output is a tool message; reasoning items are dropped."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
    return out


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def _head(req: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """The response object before its answer: the request's settings as OpenAI echoes them."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "model": req.model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store, "temperature": req.temperature, "text": {"format": fmt},
        "tool_choice": (req.tool_choice.model_dump() if req.tool_choice is not None and
                        not isinstance(req.tool_choice, str) else req.tool_choice or ("auto" if req.tools else "none")),
        "tools": [t.model_dump() for t in req.tools or ()], "top_p": req.top_p, "truncation": "disabled",
        "usage": None, "user": req.user,
    }


def _finished(head: dict[str, Any], items: OutputItems, finish_reason: str | None, usage: dict[str, Any] | None,
              error: str | None) -> dict[str, Any]:
    """The whole response once its answer is in: `completed`; `incomplete` when max_output_tokens cut it;
    `failed` when the engine failed (finish_reason "error"; `error`: its message where known)."""
    status = _status(finish_reason)
    return {**head, "status": status, "completed_at": int(time.time()) if status == "completed" else None,
            "error": {"code": "server_error", "message": error or "the model failed while generating"}
            if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": items.items, "usage": _usage(usage) if usage is not None else None}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}


def _status(finish_reason: str | None) -> str:
    return {"length": "incomplete", "error": "failed"}.get(finish_reason, "completed")


def _item_status(finish_reason: str | None) -> str:
    return "completed" if _status(finish_reason) == "completed" else "incomplete"


def _not_found(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


def _renamed(e: ApiError) -> ApiError:
    """An error of the chat layer, naming the Responses field the client sent."""
    if e.param is None:
        return e
    head = e.param.split(".")[0]
    return ApiError(e.status, str(e), e.type, _PARAMS.get(head, e.param), e.code, e.headers)
