"""A sliding window's speed: the same model with and without a window, at 4x the window.

    python loadtests/bench_window.py --window 512 --repeats 3

One engine per form of the model (default: the embedded SmolLM2-135M, bf16 weights, compiled
step): `global` as it ships, `window` with every layer given a sliding window (Mistral's form),
`alternate` with every other layer windowed (Gemma 2's). Each decodes batches of sequences
4 x --window tokens long (median step ms) and prefills one such prompt (seconds). A windowed
layer reads at most `window` keys per query, so it should be as fast or faster, and it holds
only window + one block of KV per sequence (the KV column, measured from the pool). This is a
benchmark, not a test: it prints a table with the ratio against `global`, measured in the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()  # NOTE: before torch
import torch  # noqa: E402

from loadtests.bench_engine import _adapter, make_prompts  # noqa: E402
from loadtests.engine_timing import save_json, step_timings  # noqa: E402
from models import load_model, load_tokenizer, resolve_model  # noqa: E402
from models.transformer import DecoderLM  # noqa: E402
from server.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

FORMS = ("global", "window", "alternate")


def with_windows(model: DecoderLM, windows: tuple[int | None, ...]) -> DecoderLM:
    """`model` with the given per-layer sliding windows (its weights shared, not copied)."""
    model.config = dataclasses.replace(model.config, layer_windows=windows)
    for i, layer in enumerate(model.layers):
        layer.attn.variant = dataclasses.replace(layer.attn.variant, window=model.config.window(i))
    return model


def form_windows(form: str, num_layers: int, window: int) -> tuple[int | None, ...]:
    if form == "global":
        return ()
    return tuple(window if form == "window" or i % 2 == 0 else None for i in range(num_layers))


def bench_form(args, form: str, path: Path, tok) -> dict:
    model = load_model(path, args.dtype)
    model = with_windows(model, form_windows(form, model.config.num_layers, args.window))
    length = 4 * args.window
    engine = LLMEngine(EngineConfig(model=str(path), dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                                    max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=length + args.step_tokens + 8),
                       model=model, tokenizer=tok)
    vocab = model.config.vocab_size
    workload = {"step_prompts": {b: make_prompts(b, length, length, vocab, seed=b) for b in args.batch_sizes},
                "step_tokens": args.step_tokens, "prefill_prompt": make_prompts(1, length, length, vocab, seed=99)[0]}
    engine.generate([workload["prefill_prompt"][:8]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    timings = step_timings(_adapter(engine), workload, args.repeats)
    # the KV one sequence at 4x the window holds, read off the pool
    engine.kv.pool.reset_prefix_cache()
    engine.add_request("kv", workload["prefill_prompt"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.step()
    kv_bytes = engine.kv.pool.num_used_blocks * engine.kv_spec.bytes_per_block
    while engine.has_unfinished():
        engine.step()
    return {**timings, "kv_bytes_per_seq": kv_bytes, "step": engine.runner.step, "length": length}


def print_table(args, results: dict) -> None:
    base = results["global"]
    print(f"\nmodel {args.model}, {args.dtype}, window {args.window}, sequences of {4 * args.window} tokens; "
          f"medians of {args.repeats}; ratio = global time / this time (>1: faster)")
    header = f"{'form':<10} {'step':>9} " + " ".join(f"{'b' + str(b) + ' ms':>9} {'x':>5}" for b in args.batch_sizes)
    print(header + f" {'prefill s':>10} {'x':>5} {'KV/seq MiB':>11} {'x':>5}")
    for form, r in results.items():
        cells = " ".join(f"{r['step_ms'][b]:9.2f} {base['step_ms'][b] / r['step_ms'][b]:5.2f}" for b in args.batch_sizes)
        print(f"{form:<10} {r['step']:>9} {cells} {r['prefill_s']:10.3f} {base['prefill_s'] / r['prefill_s']:5.2f} "
              f"{r['kv_bytes_per_seq'] / 2**20:11.2f} {base['kv_bytes_per_seq'] / r['kv_bytes_per_seq']:5.2f}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--step-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    forms = args.forms.split(",")
    if forms[0] != "global":
        raise SystemExit("--forms must start with global (the ratio's base)")
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    results = {form: bench_form(args, form, path, tok) for form in forms}
    print_table(args, results)
    save_json(args, results)
    return results


if __name__ == "__main__":
    main()
