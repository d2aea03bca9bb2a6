"""vLLM's side of bench_structured.py: runs inside `.venv-peers` (made by `make peers`), never in tests.

    .venv-peers/bin/python loadtests/vllm_structured.py SPEC.json OUT.json

The same requests and figures as attnserve's side, through vLLM's `structured_outputs` (its
xgrammar backend) with free whitespace off, as attnserve's JSON grammars have it.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], dtype="bfloat16", seed=0, max_model_len=2048, enable_prefix_caching=True)

    def params(schema: str | None, max_tokens: int) -> SamplingParams:
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True) if schema else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)

    def run(prompts, schema) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params(schema, spec["max_tokens"]), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    run(prompts[:2], spec["long_schema"])  # warm-up, and the long schema compiled
    out: dict = {"tok_s": {}}
    for batch in spec["batches"]:
        runs = {"none": [], "json": []}
        for _ in range(spec["repeats"]):
            runs["none"].append(run(prompts[:batch], None))
            runs["json"].append(run(prompts[:batch], spec["long_schema"]))
        out["tok_s"][batch] = {k: statistics.median(v) for k, v in runs.items()}
    ttft = {"new": [], "cached": []}
    for i, schema in enumerate(spec["ttft_schemas"]):
        for kind in ("new", "cached"):
            start = time.perf_counter()
            llm.generate([prompts[i]], params(schema, 1), use_tqdm=False)
            ttft[kind].append(time.perf_counter() - start)  # one token: the request's whole time is its TTFT
    out["ttft_ms"] = {k: 1000 * statistics.median(v) for k, v in ttft.items()}
    # every schema once, greedy, with vLLM's defaults (free whitespace allowed): the answers' texts
    answers = llm.generate(prompts[:len(spec["schemas"])], [
        SamplingParams(temperature=0.0, max_tokens=spec["answer_tokens"],
                       structured_outputs=StructuredOutputsParams(json=s)) for s in spec["schemas"]], use_tqdm=False)
    out["answers"] = [o.outputs[0].text for o in answers]
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":  # NOTE: vLLM spawns its engine core; the guard keeps the child from re-running this
    main(*sys.argv[1:])
