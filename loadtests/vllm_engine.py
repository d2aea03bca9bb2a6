"""vLLM's side of bench_engine.py: runs inside `.venv-peers` (made by `make peers`), never in tests.

    .venv-peers/bin/python loadtests/vllm_engine.py SPEC.json OUT.json

SPEC holds the model directory, dtype and the same prompts bench_engine gives attnserve; OUT
gets the same figures, measured the same way: output tokens over the wall time of one
`generate` of every prompt at once (prefix cache reset between repeats), TTFT p50, and the step
timings of engine_timing.py through vLLM's own `LLMEngine.step()`. Thread binding comes from
the VLLM_CPU_* environment that bench_engine sets.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_timing import EngineAdapter, step_timings  # noqa: E402


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, disable_log_stats=False,
              max_model_len=spec["max_model_len"], enable_prefix_caching=True)
    startup = time.perf_counter() - start

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm.generate(prompts[:2], params(2), use_tqdm=False)  # warm-up
    runs, ttfts = [], []
    for _ in range(spec["repeats"]):
        llm.reset_prefix_cache()  # NOTE: repeats must not reuse the last run's prefill
        t = time.perf_counter()
        outs = llm.generate(prompts, params(spec["max_tokens"]), use_tqdm=False)
        elapsed = time.perf_counter() - t
        runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
        ttfts.append(statistics.median(o.metrics.first_token_latency for o in outs))

    engine = llm.llm_engine
    adapter = EngineAdapter(
        add=lambda rid, ids, n: engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params(n)),
        step=lambda: [o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids],
        busy=engine.has_unfinished_requests, reset=llm.reset_prefix_cache)
    result = {"output_tokens_per_s": statistics.median(runs), "ttft_p50_s": statistics.median(ttfts),
              "runs_tokens_per_s": runs, **step_timings(adapter, spec, spec["repeats"]),
              "startup_s": startup, "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":  # NOTE: vLLM spawns its engine core; the guard keeps the child from re-running this
    main(sys.argv[1], sys.argv[2])
