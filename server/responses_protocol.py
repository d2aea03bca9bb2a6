"""The OpenAI Responses API's request body (pydantic), validated before anything reaches an engine:
what /v1/responses takes, in its own field names, so a 400 names the field the client sent."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
)

from server.engine.sampling_params import MAX_TEMPERATURE, PRIORITY_RANGE

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Body(BaseModel):
    # NOTE: unknown fields are errors, so an unsupported parameter gets a 400 instead of being ignored.
    model_config = ConfigDict(extra="forbid")


class InputText(_Body):
    type: Literal["input_text"]
    text: StrictStr


class OutputText(_Body):
    """An earlier answer's text, as clients send `response.output` back."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


ContentPart = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(_Body):
    type: Literal["message"] = "message"  # the short form ({"role", "content"}) has no type
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[ContentPart]
    id: StrictStr | None = None
    status: ItemStatus | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr  # JSON text
    id: StrictStr | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: ItemStatus | None = None


class ReasoningItem(_Body):
    """An earlier answer's thinking, sent back by clients that echo `response.output`: accepted and
    dropped (chat templates leave earlier turns' thinking out of the prompt)."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: StrictStr | None = None
    status: ItemStatus | None = None


def _item_type(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_type),
]


class TextFormatText(_Body):
    type: Literal["text"]


class TextFormatJsonObject(_Body):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(_Body):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")] = \
        TextFormatText(type="text")


class FunctionTool(_Body):
    type: Literal["function"]
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: StrictStr


class ReasoningConfig(_Body):
    effort: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Body):
    model: StrictStr
    input: StrictStr | list[InputItem] = Field(min_length=1)
    instructions: StrictStr | None = None  # a system message for this request only (not carried on)
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ReasoningConfig | None = None
    store: StrictBool = True  # as OpenAI: kept for previous_response_id and GET unless false
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)
    stream: StrictBool = False
    user: StrictStr | None = None
    priority: StrictInt = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])  # vLLM's: --scheduling-policy priority

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, v):
        if v and any(len(k) > 64 or len(x) > 512 for k, x in v.items()):
            raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return v

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items (a string is one user message), as they are stored."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in self.input]
