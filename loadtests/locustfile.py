"""Locust users for an OpenAI-compatible server (attnserve or a peer).

Environment:
  ATTNSERVE_WORKLOAD  JSONL from loadtests/workload.py (default loadtests/out/workload.jsonl, built if missing)
  ATTNSERVE_MODELS    comma-separated served model names; MixedModelUser cycles through them (default: default)

Streaming users read the SSE body chunk by chunk as it arrives (FastHttpUser.iter_lines buffers
1 KiB, which would hide the first token) and fire their own `TTFT` and `ITL` request events;
`TOKENS` events carry the output token count in `response_length`. `_OpenAIUser.stream` serves chat
and text completions alike (loadtests/priority_locustfile.py streams both); where a body asks for
`continuous_usage_stats`, a TTFT or ITL event's `response_length` is the tokens its chunk brought (the
server merges the chunks a slow reader missed), so that tokens can be counted as they arrive.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from locust import HttpUser, between, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests.workload import DEFAULT_WORKLOAD, ensure  # noqa: E402

_LOCK = threading.Lock()
_WORKLOAD: dict[str, list[dict]] = {}


def workload() -> dict[str, list[dict]]:
    with _LOCK:
        if not _WORKLOAD:
            path = ensure(Path(os.environ.get("ATTNSERVE_WORKLOAD", DEFAULT_WORKLOAD)))
            for line in path.read_text().splitlines():
                record = json.loads(line)
                _WORKLOAD.setdefault(record["kind"], []).append(record)
        return _WORKLOAD


def models() -> list[str]:
    return [m for m in os.environ.get("ATTNSERVE_MODELS", "default").split(",") if m]


def fire(environment, kind: str, name: str, seconds: float = 0.0, length: int = 0, exception=None) -> None:
    environment.events.request.fire(request_type=kind, name=name, response_time=seconds * 1000,
                                    response_length=length, exception=exception, context={})


class _OpenAIUser(HttpUser):
    abstract = True
    wait_time = between(0.1, 0.5)
    kind = "chat"
    max_tokens_cap = 128

    def on_start(self) -> None:
        self.records = workload()[self.kind]
        self.rng = random.Random()
        self.model_cycle = itertools.cycle(models())

    def pick(self) -> tuple[str, dict]:
        return next(self.model_cycle), self.rng.choice(self.records)

    def chat_body(self, model: str, record: dict) -> dict:
        return {"model": model, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": min(record["max_tokens"], self.max_tokens_cap), "temperature": 0.7,
                "messages": [{"role": "user", "content": f"{record['prompt']}\n\nContinue this text."}]}

    def stream(self, path: str, body: dict, name: str) -> None:
        """POST a streamed `body` to `path` (/v1/chat/completions or /v1/completions); TTFT, ITL and
        TOKENS events under `name`."""
        start = time.perf_counter()
        last, tokens, usage_tokens, error, finish, counted = None, 0, None, None, None, 0
        with self.client.post(path, json=body, stream=True, name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            buffer = b""
            for piece in resp.iter_content(chunk_size=None):
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    data = json.loads(event[6:])
                    if "error" in data:
                        error = data["error"].get("message", "error")
                        continue
                    usage = data.get("usage")
                    if usage:
                        usage_tokens = usage.get("completion_tokens")
                    choices = data.get("choices") or []
                    finish = (choices[0].get("finish_reason") if choices else None) or finish
                    if choices and (choices[0].get("delta", {}).get("content") or choices[0].get("text")):
                        now = time.perf_counter()
                        brought = usage_tokens - counted if usage and usage_tokens is not None else 0
                        counted += brought
                        if last is None:
                            fire(self.environment, "TTFT", name, now - start, brought)
                        else:
                            fire(self.environment, "ITL", name, now - last, brought)
                        last, tokens = now, tokens + 1
            if error:
                resp.failure(error)
            elif last is None and finish is None:  # an immediate stop is an answer; a cut stream is not
                resp.failure("stream ended without content or finish_reason")
            else:
                resp.success()
        fire(self.environment, "TOKENS", name, 0.0, usage_tokens if usage_tokens is not None else tokens)


class _StreamingChatUser(_OpenAIUser):
    abstract = True
    request_name = "chat-stream"  # formatted with the model: one stats row per name

    @task
    def chat(self) -> None:
        model, record = self.pick()
        self.stream("/v1/chat/completions", self.chat_body(model, record), self.request_name.format(model=model))


class ChatStreamUser(_StreamingChatUser):
    """Streaming chat with workload prompts of lognormal length."""


class CompletionUser(_OpenAIUser):
    """Non-streaming text completions."""

    @task
    def complete(self) -> None:
        model, record = self.pick()
        body = {"model": model, "prompt": record["prompt"], "max_tokens": min(record["max_tokens"], 64),
                "temperature": 0.7}
        with self.client.post("/v1/completions", json=body, name="completion", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            fire(self.environment, "TOKENS", "completion", 0.0, resp.json()["usage"]["completion_tokens"])
            resp.success()


class SharedPrefixUser(_StreamingChatUser):
    """One long system passage shared by every request: the prefix cache should serve it."""

    kind = "shared_prefix"
    request_name = "shared-prefix"


class LongPromptUser(_StreamingChatUser):
    """Prompts of 1,000-3,000 words: prefill-heavy, chunked."""

    kind = "long"
    max_tokens_cap = 32
    request_name = "long-prompt"


class MixedModelUser(_StreamingChatUser):
    """Round-robin over ATTNSERVE_MODELS (e.g. the MHA, GQA and MQA forms of one model)."""

    request_name = "mixed:{model}"
