"""Anthropic Messages API bodies (pydantic) and its error shape, as the official `anthropic` SDK sends
and reads them. Unknown fields and block types are errors (a 400), as in server/protocol.py."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

MESSAGES_PATH = "/v1/messages"


class _Body(BaseModel):
    # NOTE: unknown fields are errors, so an unsupported parameter gets a 400 instead of being ignored.
    model_config = ConfigDict(extra="forbid")


class _Cached(_Body):
    # prompt caching is automatic here (prefix blocks): a block's cache_control is accepted and has no effect
    cache_control: dict[str, Any] | None = None


class TextBlock(_Cached):
    type: Literal["text"]
    text: StrictStr
    citations: list[Any] | None = None  # an answer's block sent back in the history carries it (null)


class ToolUseBlock(_Cached):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(_Cached):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or ())
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Body):
    """An earlier answer's thinking, sent back: dropped from the prompt, as Anthropic does."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: StrictStr


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]


class ToolDefinition(_Cached):
    type: Literal["custom"] | None = None  # server tools (web search, ...) are not offered
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class _ToolChoice(_Body):
    disable_parallel_tool_use: StrictBool | None = None


class ToolChoiceAuto(_ToolChoice):
    type: Literal["auto"]


class ToolChoiceAny(_ToolChoice):
    type: Literal["any"]


class ToolChoiceTool(_ToolChoice):
    type: Literal["tool"]
    name: StrictStr


class ToolChoiceNone(_Body):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Body):
    type: Literal["enabled"]
    budget_tokens: StrictInt = Field(ge=1)


class ThinkingDisabled(_Body):
    type: Literal["disabled"]


class ThinkingAdaptive(_Body):
    """The model decides how long to think: a reasoning model's own default."""

    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class JsonOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """Structured outputs (`format`: the answer's text matches the schema) and reasoning effort."""

    effort: Literal["low", "medium", "high"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(_Body):
    user_id: StrictStr | None = None


class CountTokensRequest(_Body):
    """What makes a prompt: `POST /v1/messages/count_tokens`, and the base of a Messages request."""

    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # automatic here, as a block's (see _Cached)


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=1)
    stream: StrictBool = False
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self):
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error type for a status; any other 5xx is an api_error."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
