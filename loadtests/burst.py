"""Burst mode of compare_http.py: N concurrent non-streaming completions of a fixed length (EOS
ignored, greedy), timed over HTTP or through attnserve's `LLMEngine` in-process, on the same prompts.

The in-process side runs in a process of its own (`python -m loadtests.burst SPEC.json OUT.json`),
with the engine settings `attnserve serve` gives its replica, so HTTP / in-process is what serving
costs. Each side returns the wall time of every burst; a warm-up burst runs first.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WARM_UP_TOKENS = 8


def burst_prompts(vocab: int, num: int, tokens: int, burst: int | str) -> list[list[int]]:
    """`num` distinct prompts of exactly `tokens` random token ids (ids below 100 hold the special
    tokens). Seeded by the burst, so every system gets the same prompts and no burst hits the prefix
    cache an earlier one filled."""
    rng = random.Random(f"burst-{burst}")
    return [[rng.randrange(100, vocab) for _ in range(tokens)] for _ in range(num)]


def _check(tokens: int, prompts: list, max_tokens: int) -> None:
    if tokens != len(prompts) * max_tokens:
        raise RuntimeError(f"expected {len(prompts)} x {max_tokens} completion tokens, got {tokens}")


async def _http_burst(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> float:
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(prompt: list[int]) -> int:
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        wall = time.perf_counter() - start
    _check(tokens, prompts, max_tokens)
    return wall


def http_bursts(url: str, model: str, warm_up: list[list[int]], bursts: list[list[list[int]]],
                max_tokens: int) -> list[float]:
    """Wall seconds of each burst, sent as concurrent /v1/completions requests."""
    asyncio.run(_http_burst(url, model, warm_up, WARM_UP_TOKENS))
    return [asyncio.run(_http_burst(url, model, prompts, max_tokens)) for prompts in bursts]


def engine_bursts(spec: dict) -> list[float]:
    """The same bursts through `LLMEngine.generate`, in this process."""
    import torch

    from server.engine import EngineConfig, LLMEngine, SamplingParams
    from server.serve_config import ServeConfig

    model, threads = spec["model_dir"], spec["threads"]
    torch.set_num_threads(threads)
    # NOTE: the EngineConfig that `attnserve serve --model default=DIR --dtype D --threads T` builds
    shared = EngineConfig(dtype=spec["dtype"], num_threads=threads)
    config = ServeConfig(models={"default": model}, engine=shared).engine_config(model)
    engine = LLMEngine(config)

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        start = time.perf_counter()
        results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        wall = time.perf_counter() - start
        _check(sum(len(r[0].token_ids) for r in results), prompts, max_tokens)
        return wall

    run(spec["warm_up"], WARM_UP_TOKENS)
    return [run(prompts, spec["max_tokens"]) for prompts in spec["bursts"]]


def inprocess_bursts(model_dir: Path, dtype: str, threads: int, warm_up: list[list[int]],
                     bursts: list[list[list[int]]], max_tokens: int, log: Path) -> list[float]:
    """engine_bursts in a fresh process, so it shares nothing with the benchmark driver."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp, log.open("w") as out:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model_dir": str(model_dir), "dtype": dtype, "threads": threads,
                                    "warm_up": warm_up, "bursts": bursts, "max_tokens": max_tokens}))
        code = subprocess.run([sys.executable, "-m", "loadtests.burst", str(spec), str(result)], cwd=ROOT, env=env,
                              stdout=out, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise RuntimeError(f"in-process engine exited with {code}; see {log}")
        return json.loads(result.read_text())


if __name__ == "__main__":
    from models.native.cpu_features import apply_isa_cap

    apply_isa_cap()  # NOTE: before the engine imports torch, as in `attnserve serve`'s engine process
    Path(sys.argv[2]).write_text(json.dumps(engine_bursts(json.loads(Path(sys.argv[1]).read_text()))))
