"""Reasoning models: the `<think>...</think>` part of an answer split from the rest, as vLLM's
`reasoning_content`; where a prompt leaves the model (inside its thinking or not); the thinking budgets
`reasoning_effort` stands for. No torch: the API layer parses, the replica reads its prompts.

The two parsers (`--reasoning-parser`, vLLM's names) differ only where the prompt says nothing:
- `deepseek_r1`: the template opens `<think>` in the prompt, so the output starts inside the thinking and
  may lack `<think>`; text before `</think>` is reasoning, an answer that never closes it is all reasoning.
- `qwen3`: the model opens `<think>` itself; with `enable_thinking: false` the template closes an empty
  thinking in the prompt (`<think>\\n\\n</think>`). An output that does not open with `<think>` is all content.
Both follow the prompt where it ends inside (`<think>`) or after (`</think>`) a thinking.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
CHOICES = ("auto", *PARSERS)  # --reasoning-parser

# reasoning_effort -> thinking tokens before `</think>` is forced (engine-side, per request)
EFFORT_BUDGETS = {"low": 256, "medium": 1024, "high": 4096}

# where an answer starts: inside the thinking, after it, or thinking only if it opens `<think>`
THINKING, ANSWERING, PENDING = "thinking", "answering", "pending"
STARTS = (THINKING, ANSWERING, PENDING)


def resolve(name: str | None, chat_template: str | None) -> str | None:
    """The parser a model uses: `auto` reads its chat template (one that mentions a tag thinks;
    `enable_thinking` in it means Qwen3's switch, else DeepSeek-R1's opened thinking); None: no parser."""
    if name is None:
        return None
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(CHOICES)}, not {name!r}")
        return name
    if not chat_template or (START not in chat_template and END not in chat_template):
        return None
    return "qwen3" if "enable_thinking" in chat_template else "deepseek_r1"


def answer_start(parser: str, prompt_tail: str) -> str:
    """Where the answer to a prompt ending in `prompt_tail` (its last tokens as text) starts."""
    tail = prompt_tail.rstrip()
    if tail.endswith(START):
        return THINKING
    if tail.endswith(END):
        return ANSWERING
    return THINKING if parser == "deepseek_r1" else PENDING


def effort_budget(effort: str | None, budget: int | None) -> int | None:
    """A request's thinking budget: `thinking_token_budget` where given, else its effort's preset; None: neither."""
    if budget is not None:
        return budget
    return EFFORT_BUDGETS[effort] if effort is not None else None


def _partial(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (a tag that may be forming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class ReasoningParser:
    """One answer's text, fed as it streams: each piece split into (reasoning, content). The tags
    themselves are dropped and nothing else is, so reasoning + content is the text without them; a piece
    that may be the start of a tag is held back until the next (or `finish`)."""

    state: str  # one of STARTS
    held: str = ""
    opening: bool = True  # nothing taken yet: a leading `<think>` is the opening tag, in any state but answering

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning, content = [], []
        while text:
            if self.state == ANSWERING:
                content.append(text)
                break
            if self.opening:
                if text.startswith(START):
                    text, self.opening, self.state = text[len(START):], False, THINKING
                    continue
                if START.startswith(text):  # the opening tag may be forming
                    self.held = text
                    break
                self.opening = False
                if self.state == PENDING:  # qwen3: an answer that does not open the thinking has none
                    self.state = ANSWERING
                    continue
            i = text.find(END)
            if i >= 0:
                reasoning.append(text[:i])
                text, self.state = text[i + len(END):], ANSWERING
                continue
            k = _partial(text, END)
            reasoning.append(text[:len(text) - k])
            self.held = text[len(text) - k:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text held back, once the answer has ended."""
        held, self.held = self.held, ""
        return (held, "") if self.state == THINKING else ("", held)
