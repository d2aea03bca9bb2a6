"""Per-request sampling parameters, validated once at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass

from server.engine.errors import InvalidRequestError
from server.reasoning import STARTS, THINKING

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's limit; the HTTP schema uses this one too
# Below this a temperature is greedy (vLLM's epsilon): logits / 1e-300 are +-inf, whose softmax is NaN
GREEDY_BELOW = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
PRIORITY_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit integer, as vLLM's (and the HTTP schema's) priority


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What a constrained request's text must match (compiled by xgrammar: server/engine/grammar.py).

    `spec` is text in every kind, so that it is the grammar's cache key: a JSON schema, a regex, an
    EBNF grammar, or the choices as a JSON list. `kind` labels the metrics (`label`, e.g. tool_call).
    JSON allows no free whitespace unless `any_whitespace`: a small model otherwise fills max_tokens
    with newlines inside an object.
    """

    kind: str
    spec: str = ""
    any_whitespace: bool = False
    label: str = ""
    param: str = "structured_outputs"  # the request field it came from: errors name it

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_KINDS, "structured_outputs", f"kind must be one of {', '.join(STRUCTURED_KINDS)}")
        _check(isinstance(self.spec, str), "structured_outputs", "the spec must be text")
        if not self.label:
            object.__setattr__(self, "label", self.kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec, self.any_whitespace


@dataclass(frozen=True)
class Reasoning:
    """A reasoning model's thinking as the engine follows it (server/engine/thinking.py): its tags as
    tokens, where the answer starts (server/reasoning.py: inside the thinking, after it, or thinking only
    if it opens the tag), and the thinking tokens before the end tag is forced (None: unlimited)."""

    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    start: str = THINKING
    budget: int | None = None

    def __post_init__(self) -> None:
        _check(len(self.start_token_ids) > 0 and len(self.end_token_ids) > 0, "reasoning", "tags must have tokens")
        _check(self.start in STARTS, "reasoning", f"start must be one of {', '.join(STARTS)}")
        _check(self.budget is None or (isinstance(self.budget, int) and self.budget >= 0), "thinking_token_budget",
               "must be an integer >= 0")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param}: {message}", param)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 disable those filters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # alternatives per token; 0 = only the sampled token's logprob
    # per prompt token after the first, its logprob, its rank and this many alternatives (vLLM's field;
    # completions' echo); computed in the prefill that serves the request
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # constrained decoding: the text must match this
    thinking_budget: int | None = None  # the request's (None: the server's); the replica makes it `reasoning`
    reasoning: Reasoning | None = None  # a reasoning model's thinking: budget, and the grammar only after it
    # scheduling, not sampling: lower is served first under --scheduling-policy priority (vLLM's field);
    # here so that every path that carries a request's params carries it
    priority: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # NOTE: 0 only scores the prompt (completions' echo): the API allows it only there
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 0, "max_tokens", "must be an integer >= 0")
        _check(math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"must be in [0, {MAX_TEMPERATURE:g}]")
        _check(math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive integer")
        _check(math.isfinite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63), "seed", "must be a 64-bit integer")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN for s in self.stop), "stop",
               f"stop strings must be non-empty and at most {MAX_STOP_STRING_LEN} characters")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(math.isfinite(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        _check(math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty",
               "must be in (0, 10]")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        _check(isinstance(self.priority, int) and not isinstance(self.priority, bool)
               and PRIORITY_RANGE[0] <= self.priority <= PRIORITY_RANGE[1], "priority",
               f"must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]")
        _check(self.thinking_budget is None or (isinstance(self.thinking_budget, int) and self.thinking_budget >= 0),
               "thinking_token_budget", "must be an integer >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
