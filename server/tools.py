"""OpenAI tool calling over any chat template: tools into the prompt, a call's JSON shape as a
grammar when a call is required, and the model's text back into `tool_calls`, whole or streamed.

Template families: a template that takes `tools` (Qwen 2.5 / 3, Hermes, SmolLM3, Llama 3.1+...)
renders them itself; any other (the default model's) gets the Hermes convention in its system
message. The `auto` parser reads Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
which both produce. No torch here.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOL_CALLS = 16  # calls in one answer, by default (--max-tool-calls)

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolChoice:
    """none | auto | required | named (`name`); `parallel`: more than one call allowed, up to
    `max_calls`."""

    mode: str
    name: str | None = None
    parallel: bool = True
    max_calls: int = MAX_TOOL_CALLS

    def __post_init__(self) -> None:
        if self.max_calls < 1:
            raise ValueError("max_calls must be positive")

    @property
    def limit(self) -> int:
        """Most calls one answer may make."""
        return self.max_calls if self.parallel else 1

    @property
    def stops_early(self) -> bool:
        """The parser may end the answer before the model does (a repeated call, `limit` reached)."""
        return self.mode in ("auto", "required")


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def call_schema(tools: Sequence[dict], choice: ToolChoice) -> dict | None:
    """The JSON schema decoding is held to: a named function's arguments, or for `required` a list
    of `{"name", "arguments"}` calls of the given tools; None where the model chooses."""
    if choice.mode == "named":
        return next(_parameters(t) for t in tools if t["function"]["name"] == choice.name)
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
              "required": ["name", "arguments"]} for t in tools]
    return {"type": "array", "minItems": 1, "maxItems": choice.limit,
            "items": {"anyOf": calls} if len(calls) > 1 else calls[0]}


def template_messages(messages: Sequence[dict], tools: Sequence[dict] | None, template: str) -> tuple[list[dict], dict]:
    """(messages, extra apply_chat_template arguments) for this chat template.

    A template that names `tools` gets them, and the history's calls with their arguments as
    objects (HF's convention); any other gets the Hermes system prompt, calls written as
    `<tool_call>` text and results as `<tool_response>` user turns."""
    if "tools" in template:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": list(tools)} if tools else {})
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(c["function"]["name"])}, '
                              f'"arguments": {c["function"]["arguments"]}}}\n{TOOL_CALL_CLOSE}' for c in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(x for x in (m.get("content") or "", calls) if x)})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        prompt = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallParser:
    """One sample's text -> `delta`s (content, or tool_calls the way OpenAI streams them).

    `feed` takes each text chunk and returns the deltas it completes; `finish` the rest. A named
    function's arguments stream as they come; `required` and `auto` calls go out whole, each when
    its JSON (or `</tool_call>`) closes.

    `done`: the answer is over, whatever the model writes next: a call repeated one already made
    (a model that repeats a call goes on repeating it; the repeat is dropped) or the choice's
    `limit` of calls was reached. Text after that point is dropped; the caller stops generating."""

    choice: ToolChoice
    num_calls: int = 0
    done: bool = False
    _seen: set[tuple[str, str]] = field(default_factory=set)  # (name, canonical arguments) of the calls made
    _buffer: str = ""
    _scan: int = 0  # required: where the element scanner stands in _buffer
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _start: int | None = None

    def feed(self, text: str) -> list[dict]:
        if not text or self.done:
            return []
        mode = self.choice.mode
        if mode == "named":
            out = [] if self.num_calls else [self._call(self.choice.name, "")]
            self.num_calls = 1
            return out + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        self._buffer += text
        return self._scan_array() if mode == "required" else self._scan_tags(final=False)

    def finish(self) -> list[dict]:
        mode = self.choice.mode
        if mode == "named" and not self.num_calls:
            self.num_calls = 1
            return [self._call(self.choice.name, "")]
        if mode == "auto" and not self.done:
            return self._scan_tags(final=True)
        self._buffer = ""  # NOTE: required: what is left is an element max_tokens cut short, never content
        return []

    def _call(self, name: str, arguments: str) -> dict:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}

    def _complete(self, name: str, arguments: Any) -> list[dict]:
        """A whole call's delta, or none where it repeats one already made; sets `done`."""
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        key = (name, json.dumps(_loads(text), sort_keys=True))
        if key in self._seen:
            self.done = True
            return []
        self._seen.add(key)
        out = [self._call(name, text)]
        self.done = self.num_calls >= self.choice.limit
        return out

    def _scan_array(self) -> list[dict]:
        """`[{"name": ..., "arguments": {...}}, ...]`: each element out when its object closes."""
        out, buf = [], self._buffer
        for i in range(self._scan, len(buf)):
            ch = buf[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._start = i
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and self._start is not None:
                    item = _loads(buf[self._start:i + 1])
                    if isinstance(item, dict) and "name" in item:
                        out += self._complete(str(item["name"]), item.get("arguments", {}))
                    self._start = None
                    if self.done:
                        self._buffer, self._scan = "", 0
                        return out
        self._scan = len(buf)
        if self._start is None and self._depth <= 1:  # nothing open: what was scanned is spent
            self._buffer, self._scan = "", 0
        return out

    def _scan_tags(self, final: bool) -> list[dict]:
        """Content around `<tool_call>` blocks; a block that does not parse stays content."""
        out = []
        while True:
            buf = self._buffer
            start = buf.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(buf, TOOL_CALL_OPEN)
                if len(buf) > keep:
                    out.append({"content": buf[:len(buf) - keep]})
                self._buffer = buf[len(buf) - keep:]
                return out
            end = buf.find(TOOL_CALL_CLOSE, start)
            if end < 0 and not final:
                if buf[:start]:
                    out.append({"content": buf[:start]})
                self._buffer = buf[start:]
                return out
            body = buf[start + len(TOOL_CALL_OPEN):end if end >= 0 else len(buf)]
            item = _loads(body.strip())
            if buf[:start]:
                out.append({"content": buf[:start]})
            if isinstance(item, dict) and "name" in item:
                out += self._complete(str(item["name"]), item.get("arguments", item.get("parameters", {})))
            else:
                out.append({"content": buf[start:end + len(TOOL_CALL_CLOSE) if end >= 0 else len(buf)]})
            self._buffer = buf[end + len(TOOL_CALL_CLOSE):] if end >= 0 and not self.done else ""
            if end < 0 or self.done:
                return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may be forming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def assemble(deltas: Sequence[dict]) -> tuple[str | None, list[dict]]:
    """A whole answer from its deltas: (content or None, tool_calls)."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if c["index"] not in calls:
                calls[c["index"]] = {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                                   "arguments": ""}}
            calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments", "")
    return (content.strip() if calls else content) or None, [calls[i] for i in sorted(calls)]
