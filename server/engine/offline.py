"""Offline generation (the CLI, the benchmarks, the tests): prompts run to completion through an engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from server.engine.sampling_params import SamplingParams
from server.wire import RequestOutput, TokenLogprob


@dataclass(frozen=True)
class CompletionResult:
    """A finished sequence, for offline use (CLI, tests)."""

    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...]
    stats: Any


def generate(engine, prompts: Sequence[Sequence[int]],
             params: SamplingParams | Sequence[SamplingParams]) -> list[list[CompletionResult]]:
    """Run prompts to completion on `engine` (an LLMEngine); results per prompt (one per sample), in input order."""
    params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    ids = [f"gen-{engine.num_steps}-{i}" for i in range(len(prompts))]
    tokens: dict[tuple[str, int], list[int]] = {}
    texts: dict[tuple[str, int], list[str]] = {}
    logprobs: dict[tuple[str, int], list[TokenLogprob]] = {}
    finals: dict[tuple[str, int], RequestOutput] = {}
    for rid, prompt, p in zip(ids, prompts, params_list):
        engine.add_request(rid, list(prompt), p)
    while engine.has_unfinished():
        for o in engine.step():
            key = (o.request_id, o.index)
            tokens.setdefault(key, []).extend(o.new_token_ids)
            texts.setdefault(key, []).append(o.new_text)
            logprobs.setdefault(key, []).extend(o.new_logprobs)
            if o.finished:
                finals[key] = o
    results = []
    for rid, prompt, p in zip(ids, prompts, params_list):
        group = []
        for i in range(p.n):
            f, key = finals[(rid, i)], (rid, i)
            group.append(CompletionResult(rid, i, tuple(prompt), tuple(tokens.get(key, [])),
                                          "".join(texts.get(key, [])), f.finish_reason,
                                          tuple(logprobs.get(key, [])), f.stats))
        results.append(group)
    return results
