"""vLLM's side of bench_embeddings.py: runs inside `.venv-peers` (made by `make peers`), never in tests.

    .venv-peers/bin/python loadtests/vllm_embed.py SPEC.json OUT.json

SPEC holds the model directory, dtype and the same token ids bench_embeddings gives attnserve; OUT gets
tokens/s measured the same way (one `embed` of every input at once, median of the repeats after one
untimed run of them all) and the first `check` inputs' embeddings, for the agreement check. The
decoder runs as vLLM's pooling runner (`convert="embed"`: its causal LM adapted to embeddings),
last-token pooling, normalised. Thread binding comes from the VLLM_CPU_* environment bench_engine's
`run_vllm` sets.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM
    from vllm.config import PoolerConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, runner="pooling", convert="embed",
              pooler_config=PoolerConfig(pooling_type="LAST", use_activation=True),  # activation: L2 normalise
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_num_seqs=len(spec["prompts"]))
    startup = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    tokens = sum(len(p) for p in spec["prompts"])
    first = llm.embed(prompts, use_tqdm=False)  # warm-up: every shape of the timed runs seen once
    runs = []
    for _ in range(spec["repeats"]):
        t = time.perf_counter()
        llm.embed(prompts, use_tqdm=False)
        runs.append(tokens / (time.perf_counter() - t))
    Path(out_path).write_text(json.dumps({
        "tokens_per_s": statistics.median(runs), "runs": runs, "startup_s": startup,
        "embeddings": [o.outputs.embedding for o in first[:spec["check"]]]}))


if __name__ == "__main__":  # NOTE: vLLM spawns its engine core; the guard keeps the child from re-running this
    main(sys.argv[1], sys.argv[2])
