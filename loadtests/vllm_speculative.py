"""vLLM's side of bench_speculative.py: runs inside `.venv-peers` (made by `make peers`), never in tests.

    .venv-peers/bin/python loadtests/vllm_speculative.py SPEC.json OUT.json

SPEC holds the model directory, dtype, the speculative config (null: none) and the same chat-templated
prompts bench_speculative gives attnserve; OUT gets the same figures, measured the same way (see
`measure` there): batch 1, each request alone, decode tok/s from the request's own first and last token
times (vLLM's RequestOutput.metrics, engine-core timestamps; wall time of the request where it has none);
batch B, output tokens over the wall time of one `generate` of B prompts. Acceptance from vLLM's
per-request speculative-decoding metrics (`per_request_spec_decode_metrics="summary"`). When vLLM
refuses the configuration, OUT says so ({"skipped": the error}) and the exit status is 0.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_path)
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        spec_cfg = spec["speculative_config"]
        extra = {"speculative_config": spec_cfg, "per_request_spec_decode_metrics": "summary"} if spec_cfg else {}
        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, disable_log_stats=False,
                  max_model_len=spec["max_model_len"], enable_prefix_caching=True, **extra)
    except Exception as e:  # NOTE: vLLM refusing the config (or the CPU build lacking it) is a result, not a crash
        traceback.print_exc()
        out.write_text(json.dumps({"skipped": f"{type(e).__name__}: {e}"}))
        return

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    stats = {"drafted": 0, "accepted": 0, "steps": 0}

    def run(prompts: list[list[int]]) -> tuple[float, list]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        for o in outs:
            m = o.outputs[0].spec_decode_metrics
            if m is not None:
                hist = list(m.histogram)
                stats["drafted"] += m.num_draft_tokens
                stats["accepted"] += sum(j * c for j, c in enumerate(hist))
                stats["steps"] += sum(hist)
        return wall, outs

    def decode_rate(o, wall: float) -> float | None:
        n = len(o.outputs[0].token_ids)
        m = o.metrics
        if m is not None and getattr(m, "last_token_ts", 0) > getattr(m, "first_token_ts", 0) > 0:
            return (n - 1) / (m.last_token_ts - m.first_token_ts) if n > 1 else None
        return n / wall if n else None  # no per-token times: the request's wall time

    for batch in spec["warmup"]:  # warm-up at each batch size, as attnserve's
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], SamplingParams(temperature=0.0, max_tokens=8),
                     use_tqdm=False)
    result: dict = {"workloads": {}, "timing": None}
    for name, prompts in spec["workloads"].items():
        rows = result["workloads"][name] = {}
        for batch in spec["batch_sizes"]:
            for k in stats:
                stats[k] = 0
            runs, outputs, tokens = [], None, 0
            for _ in range(spec["repeats"]):
                if batch == 1:
                    rates, outs = [], []
                    for p in prompts[:spec["num_prompts"]]:
                        wall, (o,) = run([p])
                        outs.append(o)
                        rate = decode_rate(o, wall)
                        if rate is not None:
                            rates.append(rate)
                        if result["timing"] is None:
                            result["timing"] = "metrics" if o.metrics is not None and o.metrics.last_token_ts else "wall"
                    runs.append(statistics.median(rates) if rates else 0.0)
                else:
                    llm.reset_prefix_cache()  # NOTE: repeats must not reuse the last run's prefill
                    wall, outs = run(prompts[:batch])
                    runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
                outputs = outputs or [list(o.outputs[0].token_ids) for o in outs]
            rows[str(batch)] = {"tok_s": statistics.median(runs), "runs": runs, "outputs": outputs,
                                "num_output_tokens": tokens, **({**stats} if spec_cfg else {})}
    out.write_text(json.dumps(result))


if __name__ == "__main__":  # NOTE: vLLM spawns its engine core; the guard keeps the child from re-running this
    main(sys.argv[1], sys.argv[2])
