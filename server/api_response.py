"""Engine chunks -> OpenAI response bodies: one `ChoiceBuilder` per choice, fed every chunk, gives
the streamed path its events and the non-streamed path its whole choice from the same state (the
same tool-call parsing), so the two cannot disagree; usage and logprobs in OpenAI's shapes."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.reasoning import ReasoningParser
from server.tools import ToolCallParser, ToolChoice, assemble
from server.wire import Chunk, LogprobEntry, PromptInfo, PromptLogprob


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass
class Sample:
    """One sample's answer so far."""

    text: str = ""
    num_tokens_so_far: int = 0
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    peak_kv_bytes: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    stop_reason: str | None = None  # the stop string that ended it
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # every prompt token (prompt_logprobs, echo)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.num_tokens_so_far += len(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs = (self.logprobs or []) + list(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.num_cached_tokens, self.num_output_tokens = chunk.num_cached_tokens, chunk.num_output_tokens
            self.peak_kv_bytes = chunk.peak_kv_bytes
            self.num_draft_tokens, self.num_accepted_tokens = chunk.num_draft_tokens, chunk.num_accepted_tokens
            self.stop_reason = chunk.stop_reason

    def end(self, reason: str) -> None:
        """Ended here by the API, before the engine ended it: the tokens so far are its output."""
        self.finish_reason, self.num_output_tokens = reason, self.num_tokens_so_far


class ChoiceBuilder:
    """One choice of a response (chat or completion). `add(chunk)` returns the choice objects of the
    streamed events the chunk makes (none while a tool-call tag may be forming); `whole()` is the
    non-streamed choice. With `tools`, the text is parsed into tool calls as it comes, for both.

    A completion's `echo` (the prompt's text) comes before its text, in the first event; its `logprobs`
    (the request's k, None: not asked for) then start with the prompt's tokens, the first one's null."""

    def __init__(self, index: int, chat: bool, tools: ToolChoice | None = None, reasoning: str | None = None,
                 echo: str | None = None, logprobs: int | None = None) -> None:
        self.index, self.chat = index, chat
        self.echo, self.k = echo, logprobs
        self.echoed = False  # the first event carried the echo
        self.sample = Sample()
        # a reasoning model's chat (`reasoning`: where its answer starts): thinking -> reasoning_content
        self.reasoning = ReasoningParser(reasoning) if reasoning is not None else None
        self.thought = self.content = ""  # its reasoning and the rest of the text, so far
        self.parser = ToolCallParser(tools) if tools is not None else None
        self.deltas: list[dict] = []  # the parser's, so far
        self.stopped = False  # ended before the engine ended it (the parser is `done`): the caller aborts it

    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        if self.stopped:
            return []  # NOTE: what the engine made after the answer ended (n > 1 siblings still running) is dropped
        self.sample.add(chunk)
        if chunk.error:
            return []  # NOTE: the stream sends its error event instead; the text it had stays as it was
        if not self.chat:
            if self.echo is not None and not self.echoed:
                self.echoed = True
                return [{"index": self.index, "finish_reason": chunk.finish_reason, "text": self.echo + chunk.text,
                         "logprobs": self._echo_logprobs(chunk.logprobs, chunk.prompt_logprobs)}]
            return [{"index": self.index, "finish_reason": chunk.finish_reason, "text": chunk.text,
                     "logprobs": completion_logprobs(chunk.logprobs) if chunk.logprobs else None}]
        logprobs = chat_logprobs(chunk.logprobs) if chunk.logprobs else None
        thought, text = self._split(chunk)
        if self.parser is None:
            delta = {"reasoning_content": thought} if thought else {}
            return [{"index": self.index, "finish_reason": chunk.finish_reason,
                     "delta": delta | ({"content": text} if text else {}), "logprobs": logprobs} | _stop(chunk)]
        deltas, finish = self.parser.feed(text), chunk.finish_reason
        if finish is None and self.parser.done:  # a repeated call, or the last one allowed: the answer ends here
            finish, self.stopped = "stop", True
            self.sample.end(finish)
        deltas += self.parser.finish() if finish else []
        self.deltas += deltas
        deltas = ([{"reasoning_content": thought}] if thought else []) + deltas
        events = [{"index": self.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas[:-1]]
        if deltas or finish or chunk.logprobs:  # else: text held back, a <tool_call> tag may be forming
            events.append({"index": self.index, "finish_reason": self._finish_reason(finish),
                           "delta": deltas[-1] if deltas else {}, "logprobs": logprobs} | _stop(chunk))
        return events

    def whole(self) -> dict[str, Any]:
        s = self.sample
        if not self.chat:
            if self.echo is not None:
                return {"index": self.index, "finish_reason": s.finish_reason, "text": self.echo + s.text,
                        "logprobs": self._echo_logprobs(s.logprobs or (), s.prompt_logprobs)}
            return {"index": self.index, "finish_reason": s.finish_reason, "text": s.text,
                    "logprobs": completion_logprobs(s.logprobs) if s.logprobs is not None else None}
        message: dict[str, Any] = {"role": "assistant", "content": s.text if self.reasoning is None else self.content}
        if self.parser is not None:  # NOTE: what was streamed: a call cut short, or text after the answer ended, is not content
            content, calls = assemble(self.deltas)
            message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        if self.reasoning is not None:
            message["reasoning_content"] = self.thought or None
        return {"index": self.index, "finish_reason": self._finish_reason(s.finish_reason), "message": message,
                "logprobs": chat_logprobs(s.logprobs) if s.logprobs is not None else None, "stop_reason": s.stop_reason}

    def _echo_logprobs(self, entries, prompt: tuple[PromptLogprob, ...] | None) -> dict[str, Any] | None:
        """The prompt's tokens, then the answer's (None without logprobs, or when the sample ended before its
        prompt's were computed)."""
        if self.k is None or prompt is None:
            return None
        return completion_logprobs(entries, prompt, self.k)

    def _split(self, chunk: Chunk) -> tuple[str, str]:
        """The chunk's text as (reasoning, content). NOTE: before the tool-call parser, which sees only the answer."""
        if self.reasoning is None:
            return "", chunk.text
        thought, text = self.reasoning.feed(chunk.text)
        if chunk.finish_reason is not None:
            held_thought, held_text = self.reasoning.finish()
            thought, text = thought + held_thought, text + held_text
        self.thought, self.content = self.thought + thought, self.content + text
        return thought, text

    def _finish_reason(self, reason: str | None) -> str | None:
        """An answer that stopped with tool calls finishes as `tool_calls`; one cut short keeps its reason."""
        if reason == "stop" and self.parser is not None and self.parser.num_calls:
            return "tool_calls"
        return reason


def _stop(chunk: Chunk) -> dict[str, Any]:
    """A chat choice's last event carries `stop_reason` (as vLLM's): the stop string that ended it, or null."""
    return {"stop_reason": chunk.stop_reason} if chunk.finish_reason is not None else {}


def usage(infos: list[PromptInfo], samples: list[Sample], speculative: bool = False) -> dict[str, Any]:
    """`samples`: per prompt in order, its n samples. `speculative`: the model drafts tokens; its drafted /
    accepted counts join the usage (only then, so other models' usage keeps its shape)."""
    prompt = sum(i.num_prompt_tokens for i in infos)
    completion = sum(s.num_output_tokens for s in samples)
    n = len(samples) // max(1, len(infos))
    cached = sum(samples[i * n].num_cached_tokens for i in range(len(infos)))
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "kv_cache_bytes": sum(s.peak_kv_bytes for s in samples)}
    if speculative:
        body["speculative"] = {"drafted": sum(s.num_draft_tokens for s in samples),
                               "accepted": sum(s.num_accepted_tokens for s in samples)}
    return body


def usage_so_far(infos: list[PromptInfo], samples: list[Sample]) -> dict[str, int]:
    prompt = sum(i.num_prompt_tokens for i in infos)
    completion = sum(s.num_tokens_so_far for s in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(entries: list[LogprobEntry] | tuple[LogprobEntry, ...],
                        prompt: tuple[PromptLogprob, ...] = (), k: int = 0) -> dict[str, Any]:
    """OpenAI's legacy shape; with echo the `prompt`'s tokens first (their `k` best as top_logprobs), the
    first one's logprob and top_logprobs null, as OpenAI's were."""
    rows = [(e.token, e.logprob, None if e.top is None else {t: v for _, t, v in e.top[:k]}) for e in prompt]
    rows += [(e.token, e.logprob, {t: v for t, v, _ in e.top}) for e in entries]
    offsets, pos = [], 0
    for token, _, _ in rows:
        offsets.append(pos)
        pos += len(token)
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [r[2] for r in rows], "text_offset": offsets}


def vllm_prompt_logprobs(prompt: tuple[PromptLogprob, ...] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: null for the first token, then per token {id: {logprob, rank,
    decoded_token}} for the prompt's own token and its alternatives (None: never computed)."""
    if prompt is None:
        return None
    out: list[dict[str, Any] | None] = [None]
    for e in prompt[1:]:
        entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for rank, (token_id, text, value) in enumerate(e.top or (), 1):
            entry.setdefault(str(token_id), {"logprob": value, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out


def chat_logprobs(entries: list[LogprobEntry] | tuple[LogprobEntry, ...]) -> dict[str, Any]:
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, v, b in e.top]}
                        for e in entries]}
