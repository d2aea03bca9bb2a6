"""What constrained decoding costs, attnserve next to vLLM on the same requests (one run).

    python loadtests/bench_structured.py [--batches 1 16] [--max-tokens 64] [--repeats 3] [--systems attnserve,vllm]

- **Compile**: time to first token of a batch-1 request with a schema not seen before (the grammar
  compiles) and of the same request again (cached), medians over `--num-schemas` of the 50 schemas
  in structured_schemas.py; and attnserve's compile alone (GrammarCache), cold and cached.
- **Per-step overhead**: output tok/s of B requests decoding `--max-tokens` greedy tokens each,
  every one constrained by a JSON schema (an array of at least 64 objects, so no request ends
  early), against the same requests unconstrained; medians of `--repeats`.

vLLM runs in `.venv-peers` (`make peers`) through vllm_structured.py, with `structured_outputs`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()

from loadtests.servers import peer_isa_env  # noqa: E402
from loadtests.structured_schemas import SCHEMAS, messages  # noqa: E402
from models import resolve_model  # noqa: E402
from server.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from server.engine.grammar import GrammarCache  # noqa: E402
from server.engine.sampling_params import StructuredOutput  # noqa: E402
from server.worker import encode_prompt  # noqa: E402

# Every step of every request is constrained: the array cannot close within --max-tokens
LONG_SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}}


def workload(args, tokenizer) -> dict:
    prompts = [encode_prompt(tokenizer, "bench", messages=messages(what)) for what, _ in SCHEMAS]
    return {"prompts": prompts, "long_schema": json.dumps(LONG_SCHEMA), "schemas": [json.dumps(s) for _, s in SCHEMAS],
            "answer_tokens": args.answer_tokens,
            "ttft_schemas": [json.dumps(s) for _, s in SCHEMAS[:args.num_schemas]], "batches": args.batches,
            "max_tokens": args.max_tokens, "repeats": args.repeats}


def bench_attnserve(args) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization, num_blocks=2048,
                                    max_num_seqs=64))
    spec = workload(args, engine.tokenizer)
    long = StructuredOutput("json", spec["long_schema"])

    def run(prompts, structured) -> float:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, structured=structured)
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        return sum(len(g[0].token_ids) for g in results) / (time.perf_counter() - start)

    out = {"tok_s": {}}
    run(spec["prompts"][:2], long)  # warm-up, and the long schema compiled
    for batch in args.batches:
        prompts = spec["prompts"][:batch]
        runs = {"none": [], "json": []}
        for _ in range(args.repeats):  # NOTE: alternating, so drift hits both alike
            runs["none"].append(run(prompts, None))
            runs["json"].append(run(prompts, long))
        out["tok_s"][batch] = {k: statistics.median(v) for k, v in runs.items()}
    ttft = {"new": [], "cached": []}
    for i, text in enumerate(spec["ttft_schemas"]):
        params = SamplingParams(max_tokens=1, temperature=0, structured=StructuredOutput("json", text))
        for kind in ("new", "cached"):
            result = engine.generate([spec["prompts"][i]], params)[0][0]
            ttft[kind].append(result.stats.ttft)
    out["ttft_ms"] = {k: 1000 * statistics.median(v) for k, v in ttft.items()}
    cache = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    start = time.perf_counter()
    cache.compiler()
    out["tokenizer_info_ms"] = 1000 * (time.perf_counter() - start)
    compile_ms = {"cold": [], "cached": []}
    for _, schema in SCHEMAS:
        spec_ = StructuredOutput("json", json.dumps(schema))
        for kind in ("cold", "cached"):
            start = time.perf_counter()
            cache.get(spec_)[0].result()
            compile_ms[kind].append(1000 * (time.perf_counter() - start))
    out["compile_ms"] = {k: (statistics.median(v), max(v)) for k, v in compile_ms.items()}
    answers = engine.generate(spec["prompts"], [
        SamplingParams(max_tokens=args.answer_tokens, temperature=0, structured=StructuredOutput("json", s))
        for s in spec["schemas"]])
    out["answers"] = [g[0].text for g in answers]
    return out


def num_valid(answers: list[str]) -> int:
    """Answers that parse as JSON and validate against their schema."""
    import jsonschema

    valid = 0
    for text, (_, schema) in zip(answers, SCHEMAS):
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


def bench_vllm(args) -> dict:
    python = Path(args.peers_venv) / "bin" / "python"
    if not python.exists():
        return {"skipped": f"{python} not found: run `make peers`"}
    from models import load_tokenizer

    spec = workload(args, load_tokenizer(resolve_model(args.model)))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           **peer_isa_env()}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps({**spec, "model": str(resolve_model(args.model))}))
        proc = subprocess.run([str(python), str(Path(__file__).with_name("vllm_structured.py")), str(spec_path),
                               str(out_path)], cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"skipped": f"vLLM failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}"}
        return json.loads(out_path.read_text())


def print_table(args, results: dict) -> None:
    print(f"\nconstrained decoding, {args.max_tokens} greedy tokens per request, medians of {args.repeats}")
    print("| system | batch | tok/s unconstrained | tok/s every request constrained | step overhead |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} | | | |")
            continue
        for batch, t in r["tok_s"].items():
            print(f"| {name} | {batch} | {t['none']:.1f} | {t['json']:.1f} | {t['none'] / t['json'] - 1:+.1%} |")
    print("\n| system | TTFT, new schema (ms) | TTFT, same schema again (ms) |")
    print("|---|---:|---:|")
    for name, r in results.items():
        if "skipped" not in r:
            print(f"| {name} | {r['ttft_ms']['new']:.1f} | {r['ttft_ms']['cached']:.1f} |")
    print(f"\n| system | answers to the {len(SCHEMAS)} schemas that parse and validate (greedy, "
          f"{args.answer_tokens} tokens at most) |")
    print("|---|---:|")
    for name, r in results.items():
        if "answers" in r:
            whitespace = "no free whitespace" if name == "attnserve" else "its defaults: free whitespace"
            print(f"| {name} ({whitespace}) | {num_valid(r['answers'])} / {len(r['answers'])} |")
    ours = results.get("attnserve")
    if ours:
        print(f"\nattnserve GrammarCache, {len(SCHEMAS)} schemas: compile cold median "
              f"{ours['compile_ms']['cold'][0]:.2f} ms (max {ours['compile_ms']['cold'][1]:.2f}), cached "
              f"{1000 * ours['compile_ms']['cached'][0]:.1f} us; tokenizer info once {ours['tokenizer_info_ms']:.0f} ms")
    vllm = results.get("vllm", {})
    if ours and "tok_s" in vllm:
        for batch in ours["tok_s"]:
            mine, theirs = ours["tok_s"][batch]["json"], vllm["tok_s"][batch]["json"]
            print(f"batch {batch}, constrained: attnserve / vLLM = {mine / theirs:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", help="attnserve's weights (vLLM always reads the bf16 checkpoint)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-schemas", type=int, default=10)
    p.add_argument("--answer-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--systems", default="attnserve,vllm")
    p.add_argument("--peers-venv", default=str(ROOT / ".venv-peers"))
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    results = {}
    for name in args.systems.split(","):
        results[name] = {"attnserve": bench_attnserve, "vllm": bench_vllm}[name](args)
    if "vllm" in results and "tok_s" in results["vllm"]:
        results["vllm"]["tok_s"] = {int(k): v for k, v in results["vllm"]["tok_s"].items()}
    print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
