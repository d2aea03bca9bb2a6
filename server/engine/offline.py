"""Offline generation (the CLI, the benchmarks, the tests): prompts run to completion through an engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from server.engine.admission import validate_embedding
from server.engine.pooling import EMBED_PARAMS
from server.engine.sampling_params import SamplingParams
from server.wire import LoraRef, RequestOutput, TokenLogprob


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
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # per prompt token after the first (prompt_logprobs)


def generate(engine, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
             lora: LoraRef | Sequence[LoraRef | None] | None = None) -> list[list[CompletionResult]]:
    """Run prompts to completion on `engine` (an LLMEngine); results per prompt (one per sample), in input order.
    `lora`: one LoRA adapter for every prompt, or one (None: the base model) per prompt."""
    params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
    ids = [f"gen-{engine.num_steps}-{i}" for i in range(len(prompts))]
    tokens: dict[tuple[str, int], list[int]] = {}
    texts: dict[tuple[str, int], list[str]] = {}
    logprobs: dict[tuple[str, int], list[TokenLogprob]] = {}
    finals: dict[tuple[str, int], RequestOutput] = {}
    scored: dict[tuple[str, int], tuple[TokenLogprob, ...]] = {}
    for rid, prompt, p, ref in zip(ids, prompts, params_list, loras, strict=True):
        engine.add_request(rid, list(prompt), p, lora=ref)
    while engine.has_unfinished():
        for o in engine.step():
            key = (o.request_id, o.index)
            tokens.setdefault(key, []).extend(o.new_token_ids)
            texts.setdefault(key, []).append(o.new_text)
            logprobs.setdefault(key, []).extend(o.new_logprobs)
            if o.prompt_logprobs is not None:
                scored[key] = o.prompt_logprobs
            if o.finished:
                finals[key] = o
    results = []
    for rid, prompt, p in zip(ids, prompts, params_list):
        group = []
        for i in range(p.n):
            f, key = finals[(rid, i)], (rid, i)
            group.append(CompletionResult(rid, i, tuple(prompt), tuple(tokens.get(key, [])),
                                          "".join(texts.get(key, [])), f.finish_reason,
                                          tuple(logprobs.get(key, [])), f.stats, scored.get(key)))
        results.append(group)
    return results


def embed(engine, prompts: Sequence[Sequence[int]]) -> list[Any]:
    """Each prompt's embedding on `engine` (an LLMEngine of an embedding model), in input order: (hidden,)
    float32 numpy arrays. All are queued at once, so their prefills share steps."""
    ids = [f"embed-{engine.num_steps}-{i}" for i in range(len(prompts))]
    for prompt in prompts:
        validate_embedding(engine.info, prompt)
    for rid, prompt in zip(ids, prompts):
        engine.add_validated(rid, list(prompt), EMBED_PARAMS, final_only=True, embed=True)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    failed = [f"{rid}: {finals[rid].error}" for rid in ids if finals[rid].embedding is None]
    if failed:
        raise RuntimeError(f"embedding failed: {'; '.join(failed)}")
    return [finals[rid].embedding for rid in ids]
