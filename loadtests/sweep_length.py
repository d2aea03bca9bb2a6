"""Cost against sequence length on the live server, for the MHA, GQA and MQA forms of one model.

    python loadtests/sweep_length.py --out loadtests/out/sweep        # starts `attnserve serve` itself

For prompt lengths 64 ... 4096 tokens it measures time to first token, inter-token latency and the
request's KV-cache bytes (from `usage.kv_cache_bytes`, the most the request held), fits log-log slopes and
plots them. Next to each it puts what the model's KV costs at that length by its shape
(`kv_bytes_at_length`, from /v1/models' kv_bytes_per_token, layer_windows and block_size through
server/kv_forms.kv_bytes_at): with sliding-window layers bytes per token fall past the window, and the
request's peak can exceed it (a prompt computed in one step holds every layer's blocks until the step
ends). And it measures the peak memory of naive attention (the written-out softmax(QK^T/sqrt(d) + M)V, which
materialises L x L scores) against SDPA's flash kernel, each point in its own subprocess.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from loadtests.run_loadtest import DEFAULT_SERVE  # noqa: E402
from loadtests.servers import ROOT, attnserve_cmd, free_port, running  # noqa: E402
from server.kv_forms import kv_bytes_at  # noqa: E402

MEMORY_PROBE = """
import resource, sys, torch
import torch.nn.functional as F
from models.attention import reference_attention
impl, n, heads, dim = sys.argv[1], int(sys.argv[2]), 9, 64
torch.manual_seed(0)
q, k, v = (torch.randn(1, heads, n, dim) for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if impl == "naive":
    out, weights = reference_attention(q, k, v)
else:
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def prompt_ids(url: str, model: str, n: int) -> list[int]:
    from models.corpus import corpus_words

    words = corpus_words()
    text = " ".join(words[1000:1000 + 2 * n])
    ids = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text}, timeout=60).json()["tokens"]
    assert len(ids) >= n, "not enough text for this length"
    return ids[:n]


def measure(url: str, model: str, ids: list[int], max_tokens: int, salt: int) -> dict:
    # NOTE: a different first token per call changes every chained block hash: no prefix-cache hits,
    # so each point pays its full prefill
    ids = [100 + salt % 30000] + ids[1:]
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, times, usage = time.perf_counter(), [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            if data.get("choices"):
                times.append(time.perf_counter() - start)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0], "itl_s": statistics.median(gaps) if gaps else None,
            "kv_cache_bytes": usage["kv_cache_bytes"], "tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


def model_kv_bytes(info: dict, n: int) -> int:
    """KV bytes one sequence of n tokens holds in the model's pool, from its /v1/models entry (every layer
    global and 16-token blocks where an older server does not say)."""
    return kv_bytes_at(info["kv_bytes_per_token"], info.get("layer_windows") or (), info.get("block_size", 16), n)


def attention_memory(lengths: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"naive": [], "sdpa": []}
    for impl in out:
        for n in lengths:
            res = subprocess.run([sys.executable, "-c", MEMORY_PROBE, impl, str(n)], cwd=ROOT, capture_output=True,
                                 text=True, check=True)
            out[impl].append(int(res.stdout.strip().splitlines()[-1]))
    return out


def slope(xs, ys) -> float:
    pts = [(x, y) for x, y in zip(xs, ys) if x and y and y > 0]
    return float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0])


def plot(results: dict, memory: dict, mem_lengths: list[int], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = (("kv_cache_bytes", "KV-cache bytes per request"), ("ttft_s", "time to first token (s)"),
              ("itl_s", "inter-token latency (s)"))
    for ax, (key, title) in zip(axes.flat, panels):
        for model, rows in results.items():
            xs = [r["length"] for r in rows]
            ys = [r[key] for r in rows]
            line, = ax.loglog(xs, ys, "o-", label=f"{model} (slope {slope(xs, ys):.2f})")
            if key == "kv_cache_bytes":  # what the model's shape says a sequence of that length holds
                ax.loglog(xs, [r["kv_bytes_at_length"] for r in rows], "--", color=line.get_color(), alpha=0.6,
                          label=f"{model}: kv_bytes_at(length)")
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    ax = axes.flat[3]
    for impl, ys in memory.items():
        ax.loglog(mem_lengths, [max(y, 1) for y in ys], "o-", label=f"{impl} (slope {slope(mem_lengths, ys):.2f})")
    ax.set_xlabel("sequence length")
    ax.set_title("peak extra memory of one attention call (bytes)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = out / "sweep_length.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server that serves --models; default: start one")
    ap.add_argument("--models", default="mha,default,mqa")
    ap.add_argument("--lengths", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--memory-lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="medians of this many runs per point")
    ap.add_argument("--out", default=str(ROOT / "loadtests" / "out" / "sweep"))
    ap.add_argument("--serve-args", default="--kv-cache-memory 512MiB --threads 2")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    results: dict[str, list[dict]] = {}
    salts = itertools.count(1)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            port = free_port()
            served = {m: DEFAULT_SERVE.get(m, m) for m in models}
            url = stack.enter_context(running(attnserve_cmd(served, port, args.serve_args.split()),
                                              f"http://127.0.0.1:{port}", out / "server.log"))
        infos = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]}
        for model in models:
            ids_all = prompt_ids(url, model, max(lengths))
            measure(url, model, ids_all[:32], 4, salt=0)  # warm-up
            for n in lengths:
                runs = [measure(url, model, ids_all[:n], args.max_tokens, salt=next(salts)) for _ in range(args.repeats)]
                row = {"length": n, "kv_cache_bytes": runs[0]["kv_cache_bytes"], "tokens": runs[0]["tokens"],
                       "kv_bytes_at_length": model_kv_bytes(infos[model], n)}
                row["kv_bytes_per_token_at_length"] = row["kv_bytes_at_length"] / n
                for key in ("ttft_s", "itl_s"):
                    row[key] = statistics.median(r[key] for r in runs)
                results.setdefault(model, []).append(row)
                print(model, json.dumps(row), flush=True)
    mem_lengths = [int(x) for x in args.memory_lengths.split(",")]
    memory = attention_memory(mem_lengths)
    fits = {m: {"kv_cache_bytes": slope([r["tokens"] - 1 for r in rows], [r["kv_cache_bytes"] for r in rows]),
                "ttft_s": slope([r["length"] for r in rows], [r["ttft_s"] for r in rows])}
            for m, rows in results.items()}
    long_half = [n for n in lengths if n >= lengths[len(lengths) // 2]]
    for m, rows in results.items():
        fits[m]["ttft_s_long"] = slope(long_half, [r["ttft_s"] for r in rows if r["length"] in long_half])
    fits["attention_memory"] = {impl: slope(mem_lengths, ys) for impl, ys in memory.items()}
    report = {"results": results, "attention_memory": {"lengths": mem_lengths, **memory}, "fits": fits,
              "plot": str(plot(results, memory, mem_lengths, out))}
    print(f"\n{'model':<10}{'length':>8}{'KV bytes':>14}{'model KV':>14}{'B/token':>10}{'TTFT s':>9}{'ITL s':>9}")
    for m, rows in results.items():
        for r in rows:
            print(f"{m:<10}{r['length']:>8}{r['kv_cache_bytes']:>14}{r['kv_bytes_at_length']:>14}"
                  f"{r['kv_bytes_per_token_at_length']:>10.0f}{r['ttft_s']:>9.3f}{r['itl_s'] or 0:>9.4f}")
    print("\nlog-log slopes:", json.dumps(fits, indent=1))
    if len(models) > 1:
        ref = models[0]
        for m in models[1:]:
            ratios = sorted({a["kv_cache_bytes"] / b["kv_cache_bytes"] for a, b in zip(results[ref], results[m])})
            print(f"KV bytes {ref}/{m} at every length: {ratios}")
    (out / "sweep_length.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
