"""Step-level timings measured the same way for every engine (torch-free: vLLM's venv imports it too).

An engine is adapted as three callables: `add(request_id, prompt_ids, max_tokens)`, `step()`
returning the ids of requests that produced a token, and `busy()`; plus `reset()`, which empties
its prefix cache so that no repeat reuses the last one's prefill.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class EngineAdapter:
    add: Callable[[str, list[int], int], None]
    step: Callable[[], Sequence[str]]
    busy: Callable[[], bool]
    reset: Callable[[], object]


def decode_step_ms(engine: EngineAdapter, prompts: Sequence[list[int]], max_tokens: int, tag: str) -> float:
    """Median wall time of a step in which every one of the prompts decodes (prefill excluded)."""
    for i, p in enumerate(prompts):
        engine.add(f"{tag}-{i}", list(p), max_tokens)
    started: set[str] = set()
    times, last = [], time.perf_counter()
    while engine.busy():
        produced = set(engine.step())
        now = time.perf_counter()
        if len(started) == len(prompts) and len(produced) == len(prompts):
            times.append(now - last)
        started |= produced
        last = now
    return 1000 * statistics.median(times) if times else float("nan")


def prefill_seconds(engine: EngineAdapter, prompt: list[int], tag: str) -> float:
    """Wall time from submitting one prompt to its first token: one prefill step."""
    start = time.perf_counter()
    engine.add(tag, list(prompt), 1)
    first = None
    while engine.busy():
        if engine.step() and first is None:
            first = time.perf_counter()
    return (first or time.perf_counter()) - start


def step_timings(engine: EngineAdapter, workload: dict, repeats: int) -> dict:
    """Medians over repeats: decode step ms per batch size (`workload["step_prompts"]`, keyed by
    batch) and the seconds of one prefill of `workload["prefill_prompt"]`."""
    step_ms = {}
    for batch, prompts in workload["step_prompts"].items():
        samples = []
        for r in range(repeats):
            engine.reset()
            samples.append(decode_step_ms(engine, prompts, workload["step_tokens"], f"b{batch}-{r}"))
        step_ms[batch] = statistics.median(samples)
    prefill = []
    for r in range(repeats):
        engine.reset()
        prefill.append(prefill_seconds(engine, workload["prefill_prompt"], f"prefill-{r}"))
    return {"step_ms": step_ms, "prefill_s": statistics.median(prefill)}


def save_json(args, results: dict) -> None:
    """A benchmark's results and the arguments that made them, where --json says (if it does)."""
    import json

    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "results": results}, indent=2, default=str))
