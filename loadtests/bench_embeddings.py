"""Embeddings throughput: tokens/s of --inputs prompts of --tokens tokens through one engine (all queued at
once, their prefills batched as the scheduler packs them), median of --repeats runs after a warm-up.

    python loadtests/bench_embeddings.py --inputs 256 --tokens 128 --repeats 3

The model (default: the embedded SmolLM2-135M, as served) runs with task embed and last-token pooling,
normalised; its step is the one serving uses (native decoder, else compiled). A benchmark, not a test: it
prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()  # NOTE: before torch
import torch  # noqa: E402

from loadtests.bench_engine import make_prompts  # noqa: E402
from server.engine import EngineConfig, LLMEngine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, task="embed", pooling="last",
                                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.inputs))
    prompts = make_prompts(args.inputs, args.tokens, args.tokens, engine.info.vocab_size)
    engine.embed(prompts[:8])  # warm-up
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.embed(prompts)
        rates.append(args.inputs * args.tokens / (time.perf_counter() - start))
    print(json.dumps({"model": args.model, "step": engine.runner.step, "inputs": args.inputs, "tokens": args.tokens,
                      "threads": torch.get_num_threads(), "tokens_per_s": round(statistics.median(rates), 1),
                      "runs": [round(r, 1) for r in rates]}))


if __name__ == "__main__":
    main()
