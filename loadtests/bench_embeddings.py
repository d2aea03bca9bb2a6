"""Embeddings throughput against vLLM's pooling runner: tokens/s of --inputs prompts of --tokens tokens, all
queued at once, on the same checkpoint, weights, dtype and token ids.

    python loadtests/bench_embeddings.py --inputs 256 --tokens 128 --repeats 5

Systems (--systems, default both; one after another, each timed the same way: one call that embeds every
input, median of --repeats runs after one untimed run of them all):
  attnserve  our engine with task embed, last-token pooling, normalised; its step the one serving uses
             (native decoder, else compiled), --threads torch threads
  vllm       vLLM's CPU build (`make peers`: .venv-peers) through vllm_embed.py: `LLM(runner="pooling",
             convert="embed")`, LAST pooling, normalised, its OpenMP threads on cores 0..--threads-1
Both read the model's checkpoint (the default model's: the bf16 safetensors models.registry converts the
shipped GGUF to) in the dtype the engine computes in here (--dtype auto: bf16 on AVX512-BF16 CPUs, as in
bench_engine). --quantization none (the default) gives attnserve those bf16 weights too; auto measures the
GGUF's Q4_1 weights as `attnserve serve` runs them, against vLLM's bf16. The first --check inputs'
embeddings of the two systems are compared (cosine), to show that both compute the same thing.
A benchmark, not a test: it prints a markdown table.
"""
from __future__ import annotations

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

from loadtests.bench_engine import make_prompts, peer_parser, peer_systems, print_ratio_rows, run_vllm  # noqa: E402
from models import load_tokenizer, resolve_model  # noqa: E402
from server.engine import EngineConfig, LLMEngine  # noqa: E402

SYSTEMS = ("attnserve", "vllm")
TARGET = 1.2  # issue 38: attnserve's tokens/s >= 1.2x vLLM's


def bench_attnserve(args, prompts: list[list[int]]) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                    task="embed", pooling="last", embed_normalize=True,
                                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=len(prompts)))
    first = engine.embed(prompts)  # warm-up: every shape of the timed runs seen once
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.embed(prompts)
        runs.append(args.inputs * args.tokens / (time.perf_counter() - start))
    return {"tokens_per_s": statistics.median(runs), "runs": runs, "step": engine.runner.step,
            "embeddings": [e.tolist() for e in first[:args.check]]}


def bench_vllm(args, prompts: list[list[int]]) -> dict:
    # NOTE: vLLM's pooling runner prefills a prompt whole, so its longest prompt must fit one step
    return run_vllm(args, "vllm_embed.py", {
        "model": str(resolve_model(args.model)), "dtype": args.dtype, "prompts": prompts, "repeats": args.repeats,
        "check": args.check, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": max(args.tokens, args.max_num_batched_tokens)})


def cosines(results: dict) -> list[float] | None:
    """attnserve's and vLLM's embeddings of the same inputs, cosine each; None unless both ran."""
    if not all("embeddings" in results.get(s, {}) for s in SYSTEMS):
        return None
    ours, theirs = (torch.tensor(results[s]["embeddings"], dtype=torch.float64) for s in SYSTEMS)
    return torch.nn.functional.cosine_similarity(ours, theirs, dim=1).tolist()  # (check,)


def print_table(args, results: dict) -> None:
    ours = results.get("attnserve", {}).get("tokens_per_s")
    step = results.get("attnserve", {}).get("step", "-")
    print(f"\nmodel={args.model} dtype={args.dtype} attnserve quantization={args.quantization} step={step} "
          f"threads={args.threads} inputs={args.inputs} tokens={args.tokens} repeats={args.repeats}\n")
    print("| system | tokens/s (median) | runs | attnserve / system |\n|---|---:|---|---:|")
    print_ratio_rows(results, ours)
    if ours and "tokens_per_s" in results.get("vllm", {}):
        ratio = ours / results["vllm"]["tokens_per_s"]
        print(f"\nattnserve / vLLM: {ratio:.2f} (issue 38's target: >= {TARGET}: {'met' if ratio >= TARGET else 'not met'})")
    cos = cosines(results)
    if cos:
        print(f"embeddings agree? cosine(attnserve, vLLM) over the first {len(cos)} inputs: min {min(cos):.5f}, "
              f"mean {statistics.mean(cos):.5f} ({'yes' if min(cos) > 0.99 else 'NO'}: > 0.99 wanted)")


def main(argv=None) -> dict:
    p = peer_parser(__doc__, SYSTEMS, quantization="none")
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system; medians are reported")
    p.add_argument("--check", type=int, default=4, help="inputs whose embeddings the two systems compare")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    systems = peer_systems(p, args, SYSTEMS)
    prompts = make_prompts(args.inputs, args.tokens, args.tokens, len(load_tokenizer(resolve_model(args.model))))
    results = {name: {"attnserve": bench_attnserve, "vllm": bench_vllm}[name](args, prompts) for name in systems}
    print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps({"cosines": cosines(results), **results}, indent=2))
    return results


if __name__ == "__main__":
    main()
