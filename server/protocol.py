"""OpenAI-compatible request bodies (pydantic), validated before anything reaches an engine."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from server.engine.sampling_params import MAX_LOGPROBS, MAX_TEMPERATURE, PRIORITY_RANGE


class _Body(BaseModel):
    # NOTE: unknown fields are errors, so an unsupported parameter gets a 400 instead of being ignored.
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type json_schema, and only there (OpenAIApi checks)


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` extra field: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    # vLLM's name; None: the server's setting (no free whitespace unless `--structured-any-whitespace`)
    disable_any_whitespace: StrictBool | None = None

    @property
    def num_given(self) -> int:
        return sum(getattr(self, k) is not None for k in ("json_", "regex", "choice", "grammar")) + bool(self.json_object)


class _SamplingFields(_Body):
    model: StrictStr
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, le=10, allow_inf_nan=False)
    ignore_eos: StrictBool = False
    user: StrictStr | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: per prompt token after the first, its logprob, rank and this many alternatives (whole answers only)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: lower is served first under --scheduling-policy priority; a 64-bit integer (engine: PRIORITY_RANGE)
    priority: StrictInt = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


PromptType = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: StrictInt | None = Field(16, ge=0)  # 0 only with echo: the prompt scored, nothing generated
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: StrictBool = False  # the prompt's text (and with logprobs its tokens' logprobs) before the answer
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of not in (None, 1) or self.suffix:
            raise ValueError("best_of and suffix are not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Body):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: calls it made
    tool_call_id: StrictStr | None = None  # tool: the call this answers
    refusal: StrictStr | None = None  # sent back by clients that echo an assistant message; unused

    def problem(self) -> str | None:
        """What makes this message unusable, checked by OpenAIApi once the model is known: as
        OpenAI does, a bad model is a 404 first (and the schema stays one any message fits)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return f"a {self.role} message needs content"
        if self.tool_calls and self.role != "assistant":
            return "only assistant messages carry tool_calls"
        if (self.role == "tool") != (self.tool_call_id is not None):
            return "tool messages need tool_call_id, and only they have one"
        return None

    def as_template_input(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(_Body):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # reasoning models (server/reasoning.py): extra chat-template arguments ({"enable_thinking": false}),
    # and how long the model may think before `</think>` is forced (effort: a preset budget)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    thinking_token_budget: StrictInt | None = Field(None, ge=0)
    echo: StrictBool | None = None  # NOTE: only so that echo=true is refused with its reason (api_request.chat_request)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self


class TokenizeRequest(_Body):
    model: StrictStr
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    # with messages: rendered as a chat request's are
    tools: list[Tool] | None = Field(None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if (self.tools or self.chat_template_kwargs) and self.messages is None:
            raise ValueError("tools and chat_template_kwargs need messages")
        return self


class AttentionRequest(_Body):
    model: StrictStr
    prompt: StrictStr | list[StrictInt] | None = None
    messages: list[ChatMessage] | None = None
    layers: list[StrictInt] | None = Field(None, min_length=1)  # default: every layer

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: StrictStr
    tokens: list[StrictInt]


class EmbeddingRequest(_Body):
    """OpenAI's embeddings body: `input` a text, texts, token ids or lists of token ids; `encoding_format`
    base64 is little-endian float32; `dimensions` keeps an embedding's first values (Matryoshka)."""

    model: StrictStr
    input: PromptType
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v):
        if not v or (isinstance(v, list) and any(isinstance(x, (str, list)) and not x for x in v)):
            raise ValueError("input must not be empty, nor hold an empty text or token list")
        return v

    def inputs(self) -> list[str | list[int]]:
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            return [list(v)]
        return list(v)


class LoadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter body; `base_model`: the served model it adapts (default: the only one)."""

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)
    base_model: StrictStr | None = None


class UnloadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: StrictStr = Field(min_length=1)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
