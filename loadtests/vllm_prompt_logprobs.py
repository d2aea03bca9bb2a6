"""vLLM's side of bench_prompt_logprobs.py: runs inside `.venv-peers` (made by `make peers`), never in tests.

    .venv-peers/bin/python loadtests/vllm_prompt_logprobs.py SPEC.json OUT.json

SPEC holds the model directory, dtype, the prompt and the variants (prompt_logprobs k, null for none);
OUT gets each variant's times of one greedy `generate` of that prompt with max_tokens 1, measured as
bench_prompt_logprobs measures attnserve's (same warm-up, same interleaved order, prefix caching off so
every run prefills the whole prompt), and the prompt tokens' logprobs of the k=0 variant for the
agreement check. Thread binding comes from the VLLM_CPU_* environment bench_engine's `run_vllm` sets.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enable_prefix_caching=False,
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"])
    prompt = [TokensPrompt(prompt_token_ids=spec["prompt"])]

    def run(k: int | None) -> tuple[float, list]:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return time.perf_counter() - start, out.prompt_logprobs

    for k in spec["warmup"]:
        run(k)
    times: dict[str, list[float]] = {str(k): [] for k in spec["variants"]}
    for order in spec["orders"]:
        for k in order:
            times[str(k)].append(run(k)[0])
    scored = run(0)[1]  # [None, {token: Logprob}, ...]: the first prompt token has none
    Path(out_path).write_text(json.dumps({
        "times_s": times,
        "prompt_logprobs": [entry[tok].logprob for entry, tok in zip(scored[1:], spec["prompt"][1:])]}))


if __name__ == "__main__":  # NOTE: vLLM spawns its engine core; the guard keeps the child from re-running this
    main(sys.argv[1], sys.argv[2])
