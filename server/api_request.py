"""OpenAI request bodies -> engine values: sampling parameters, structured outputs, tool choice,
chat messages. Pure functions; a field the engine cannot take is an `ApiError` (400) here."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ValidationError

from server.engine.errors import InvalidRequestError
from server.engine.sampling_params import SamplingParams, StructuredOutput
from server.protocol import ChatCompletionRequest, error_body
from server.reasoning import effort_budget
from server.template_kwargs import template_kwargs_problem
from server.tools import MAX_TOOL_CALLS, ToolChoice, call_schema


@dataclass(frozen=True)
class ApiLimits:
    max_n: int = 16
    max_tokens: int = 8192
    max_prompts: int = 32
    max_embedding_inputs: int = 2048  # inputs of one POST /v1/embeddings (OpenAI's limit)
    max_body_bytes: int = 4 * 2**20
    max_concurrent_streams: int = 1024
    max_attention_tokens: int = 512  # POST /v1/attention: its answer grows with the prompt's square
    max_tool_calls: int = MAX_TOOL_CALLS  # calls in one answer (parallel_tool_calls: false = 1)

    def __post_init__(self) -> None:
        if min(self.max_n, self.max_tokens, self.max_prompts, self.max_embedding_inputs, self.max_body_bytes,
               self.max_concurrent_streams, self.max_attention_tokens, self.max_tool_calls) < 1:
            raise ValueError("API limits must be positive")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type_, param, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.type, self.param, self.code)


def validated(model: type[BaseModel], fields: dict[str, Any]) -> Any:
    """A body another API's request was translated into (Responses, Messages): one the schema refuses is
    the client's input, a 400 naming the field."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=where or None) from None


@dataclass(frozen=True)
class ChatRequest:
    """A chat body as the engine takes it."""

    params: SamplingParams
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None  # for the chat template; None where tool_choice is none
    parsing: ToolChoice | None  # how the answer's text turns into tool_calls (None: it stays content)
    fit_max_tokens: bool  # no max_tokens given: as many as the context leaves
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs, checked


def chat_request(body: ChatCompletionRequest, limits: ApiLimits) -> ChatRequest:
    if body.echo:
        raise ApiError(400, "echo is only available on /v1/completions: a chat answer does not repeat its "
                       "messages (prompt_logprobs scores them)", param="echo")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
    requested = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = tool_choice(body, tools, limits.max_tool_calls)
    schema = call_schema(tools, choice) if choice is not None else None
    constraint = structured(body)
    if schema is not None:
        if constraint is not None:
            raise ApiError(400, "a required or named tool_choice fixes the answer's format: drop "
                           "response_format or structured_outputs", param="tool_choice")
        constraint = StructuredOutput("json", json.dumps(schema), label="tool_call", param="tools")
    params = sampling_params(body, limits, requested, logprobs, constraint)
    # a reasoning model's thinking budget (server/reasoning.py); other models' replicas ignore it
    params = replace(params, thinking_budget=effort_budget(body.reasoning_effort, body.thinking_token_budget))
    kwargs = body.chat_template_kwargs
    if kwargs is not None and (problem := template_kwargs_problem(kwargs)) is not None:
        raise ApiError(400, f"chat_template_kwargs: {problem}", param="chat_template_kwargs")
    calling = choice is not None and choice.mode != "none"
    return ChatRequest(params, template_input(body.messages), tuple(tools) if tools and calling else None,
                       choice if calling else None, requested is None, kwargs or None)


def sampling_params(body, limits: ApiLimits, max_tokens: int | None, logprobs: int | None,
                    constraint: StructuredOutput | None) -> SamplingParams:
    if body.n > limits.max_n:
        raise ApiError(400, f"n must be <= {limits.max_n}", param="n")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise ApiError(400, f"max_tokens must be <= {limits.max_tokens}", param="max_tokens")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs is not available with stream=true (as in vLLM)", param="prompt_logprobs")
    kw: dict[str, Any] = {"n": body.n, "ignore_eos": body.ignore_eos, "logprobs": logprobs,
                          "max_tokens": limits.max_tokens if max_tokens is None else max_tokens, "priority": body.priority}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if getattr(body, name) is not None:
            kw[name] = getattr(body, name)
    kw["stop"] = tuple(body.stop or ())
    kw["stop_token_ids"] = tuple(body.stop_token_ids or ())
    kw["structured"] = constraint
    kw["prompt_logprobs"] = body.prompt_logprobs
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=e.param) from None


def structured(body) -> StructuredOutput | None:
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


def template_input(messages) -> tuple[dict, ...]:
    for i, m in enumerate(messages):
        if (problem := m.problem()) is not None:
            raise ApiError(400, problem, param=f"messages.{i}")
    return tuple(m.as_template_input() for m in messages)


def tool_choice(body, tools: list[dict] | None, max_calls: int = MAX_TOOL_CALLS) -> ToolChoice | None:
    """OpenAI's default: auto with tools, none without; a named function must be one of `tools`."""
    choice, parallel = body.tool_choice, body.parallel_tool_calls is not False
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice is None or isinstance(choice, str):
        return ToolChoice(choice or "auto", parallel=parallel, max_calls=max_calls)
    names = [t["function"]["name"] for t in tools]
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                       f"({', '.join(names)})", param="tool_choice")
    return ToolChoice("named", choice.function.name, parallel, max_calls)
