"""vLLM's side of bench_lora.py: runs inside `.venv-peers` (made by `make peers`), never in tests.

    .venv-peers/bin/python loadtests/vllm_lora.py SPEC.json OUT.json

SPEC holds the model directory, dtype, the adapters' directories, the prompts and which adapter each
uses (None: the base); OUT gets output tokens/s measured as bench_lora measures attnserve (one
`generate` of every prompt at once, greedy, ignore_eos, median of the repeats after one untimed run),
or {"skipped": the error} where vLLM's CPU build refuses LoRA.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    spec = json.loads(Path(spec_path).read_text())
    try:
        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_model_len=spec["max_model_len"],
                  enable_lora=True, max_loras=len(spec["adapters"]), max_lora_rank=spec["max_lora_rank"],
                  max_num_seqs=len(spec["prompts"]))
    except Exception as e:  # noqa: BLE001 - recorded: the peer's own refusal is the figure
        Path(out_path).write_text(json.dumps({"skipped": f"vLLM --enable-lora failed: {type(e).__name__}: {e}"[:600],
                                              "trace": traceback.format_exc()[-2000:]}))
        return
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(spec["adapters"])]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    requests = [None if i is None else loras[i] for i in spec["uses"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    out = {}
    for name, reqs in (("lora", requests), ("base", None)):
        first = llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)  # warm-up: adapters loaded
        runs = []
        for _ in range(spec["repeats"]):
            llm.reset_prefix_cache()
            t = time.perf_counter()
            res = llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
            runs.append(sum(len(o.outputs[0].token_ids) for o in res) / (time.perf_counter() - t))
        out[name] = {"tokens_per_s": statistics.median(runs), "runs": runs,
                     "tokens": [list(o.outputs[0].token_ids) for o in first]}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":  # NOTE: vLLM spawns its engine core; the guard keeps the child from re-running this
    main(sys.argv[1], sys.argv[2])
