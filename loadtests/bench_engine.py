"""Engine throughput against HF transformers on the same model, prompts, dtype and threads.

    python loadtests/bench_engine.py --dtype bfloat16 --repeats 3 --json out.json

Systems, all in this one process, one after another:
  attnserve          our engine (paged KV, continuous batching), all requests submitted at once
  hf_generate        transformers `model.generate`, static padded batches
  hf_generate_batch  transformers `model.generate_batch` (its continuous batching, paged attention)
Every request generates exactly --max-tokens greedy tokens (EOS ignored / suppressed).
Also: attnserve batch-1 decode tokens/s against the memory-bandwidth roofline
(weight bytes / measured copy bandwidth). This is a benchmark, not a test: it prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models import load_tokenizer, resolve_model  # noqa: E402
from models.loader import parse_dtype  # noqa: E402
from server.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def make_prompts(num: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [lo + (hi - lo) * i // max(num - 1, 1) for i in range(num)]  # evenly spread lengths
    rng.shuffle(lengths)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def copy_bandwidth() -> float:
    """Memory traffic of a 512 MiB copy, read + write bytes per second (median of 5)."""
    src = torch.ones(128 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.nbytes / statistics.median(times[1:])


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step must read: every weight except the embedding table,
    of which it reads one row (a tied LM head still reads it once, as the head)."""
    total = 0
    for m in model.modules():
        if hasattr(m, "packed"):
            total += m.packed.numel() * m.packed.element_size()
        for name, p in m.named_parameters(recurse=False):
            if not isinstance(m, torch.nn.Embedding):
                total += p.numel() * p.element_size()
    return total


def bench_attnserve(args, prompts) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                                    max_num_seqs=max(64, len(prompts)), max_num_batched_tokens=1024))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    runs, ttfts = [], []
    for _ in range(args.repeats):
        assert engine.kv.pool.reset_prefix_cache()  # NOTE: repeats must not reuse the last run's prefill
        t = time.perf_counter()
        results = engine.generate(prompts, params)
        runs.append(sum(len(g[0].token_ids) for g in results) / (time.perf_counter() - t))
        ttfts.append(statistics.median(g[0].stats.ttft for g in results))
    b1 = []
    for _ in range(args.repeats):
        engine.kv.pool.reset_prefix_cache()
        r = engine.generate([prompts[0][:128]], SamplingParams(max_tokens=min(args.max_tokens, 128), temperature=0, ignore_eos=True))[0][0]
        decode_time = r.stats.last_token_time - r.stats.first_token_time
        b1.append((len(r.token_ids) - 1) / decode_time if decode_time > 0 else float("nan"))
    if args.profile:
        profile_batch1(engine, prompts[0][:128], min(args.max_tokens, 128))
    bw = copy_bandwidth()
    wbytes = streamed_weight_bytes(engine.model)
    return {"output_tokens_per_s": statistics.median(runs), "ttft_p50_s": statistics.median(ttfts),
            "batch1_tokens_per_s": statistics.median(b1), "roofline_tokens_per_s": bw / wbytes,
            "weight_bytes": wbytes, "copy_bandwidth_gb_s": bw / 1e9, "runs_tokens_per_s": runs}


def profile_batch1(engine: LLMEngine, prompt: list[int], max_tokens: int) -> None:
    """Where a batch-1 decode's time goes, by operator (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    engine.kv.pool.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    print(f"\nbatch-1 profile, {max_tokens} tokens:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _hf_model(args):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=parse_dtype(args.dtype)).eval()


def bench_hf_generate(args, prompts, model) -> dict:
    """Static batching: left-padded batches of --hf-batch-size, run one after another."""
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):
        def __init__(self):
            self.time = None

        def __call__(self, input_ids, scores):
            self.time = self.time or time.perf_counter()
            return scores

    pad = 0
    gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                           pad_token_id=pad, eos_token_id=model.generation_config.eos_token_id)
    runs, ttfts = [], []
    for _ in range(args.repeats):
        start, n_out, ttft = time.perf_counter(), 0, []
        for i in range(0, len(prompts), args.hf_batch_size):
            batch = prompts[i:i + args.hf_batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            first = FirstToken()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, generation_config=gen,
                                     logits_processor=LogitsProcessorList([first]))
            n_out += (out.shape[1] - width) * len(batch)
            ttft += [first.time - start] * len(batch)
        runs.append(n_out / (time.perf_counter() - start))
        ttfts.append(statistics.median(ttft))
    return {"output_tokens_per_s": statistics.median(runs), "ttft_p50_s": statistics.median(ttfts), "runs_tokens_per_s": runs}


def bench_hf_generate_batch(args, prompts, model) -> dict:
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                           eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    runs, ttfts = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen, record_timestamps=True)
        elapsed = time.perf_counter() - t
        runs.append(sum(len(o.generated_tokens) for o in out.values()) / elapsed)
        ttfts.append(statistics.median(o.timestamps[0] - t for o in out.values() if o.timestamps))
    return {"output_tokens_per_s": statistics.median(runs), "ttft_p50_s": statistics.median(ttfts), "runs_tokens_per_s": runs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--repeats", type=int, default=1, help="runs per system; medians are reported")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of a batch-1 decode")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab = len(load_tokenizer(resolve_model(args.model)))
    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, vocab)
    results = {"attnserve": bench_attnserve(args, prompts)}
    if not args.skip_hf:
        model = _hf_model(args)
        results["hf_generate"] = bench_hf_generate(args, prompts, model)
        results["hf_generate_batch"] = bench_hf_generate_batch(args, prompts, model)
    ours = results["attnserve"]
    print(f"\nmodel={args.model} dtype={args.dtype} threads={args.threads} requests={args.num_requests} "
          f"prompts={args.min_prompt}-{args.max_prompt} new_tokens={args.max_tokens} repeats={args.repeats}")
    print(f"{'system':<20}{'output tok/s':>14}{'TTFT p50 s':>12}{'attnserve x':>13}")
    for name, r in results.items():
        ratio = ours["output_tokens_per_s"] / r["output_tokens_per_s"]
        print(f"{name:<20}{r['output_tokens_per_s']:>14.1f}{r['ttft_p50_s']:>12.2f}{ratio:>13.2f}")
    frac = ours["batch1_tokens_per_s"] / ours["roofline_tokens_per_s"]
    print(f"batch-1 decode: {ours['batch1_tokens_per_s']:.1f} tok/s = {frac:.0%} of the roofline "
          f"{ours['roofline_tokens_per_s']:.1f} tok/s ({ours['weight_bytes'] / 1e6:.0f} MB of weights at "
          f"{ours['copy_bandwidth_gb_s']:.1f} GB/s copy bandwidth)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
