"""Cache-aware routing against Serve's default (power of two choices), over HTTP.

    python loadtests/bench_routing.py --json loadtests/out/routing.json

Two replicas of the default model, each with a KV pool that holds about half of the distinct
prefixes; requests share one of 8 long system prompts (about 1,000 tokens each) and each asks
its own short question (streaming chat, greedy). Systems, one server at a time, same requests:

  cache   2 replicas, `--router cache`
  pow2    2 replicas, `--router pow2`
  single  1 replica with both replicas' pool (it holds every prefix): the hit rate to match

Reported: prefix-cache hit rate (hit / looked-up prompt tokens, from /metrics), TTFT p50 / p99,
output tok/s. This is a benchmark, not a test: it prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from loadtests.servers import ROOT, attnserve_cmd, free_port, running  # noqa: E402
from loadtests.workload import DEFAULT_WORKLOAD, ensure  # noqa: E402

SYSTEMS = ("cache", "pow2", "single")


def system_prompts(num: int, words: int, seed: int = 0) -> list[str]:
    """`num` distinct long system prompts cut from the Shakespeare workload's text."""
    texts = [json.loads(line)["prompt"] for line in ensure(DEFAULT_WORKLOAD).read_text().splitlines()[:2000]]
    vocab = " ".join(texts).split()
    rng = random.Random(seed)
    return [f"You are assistant number {i}. Study this passage before you answer.\n"
            + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(num)]


def requests(prompts: list[str], num: int, seed: int = 1) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(rng.choice(prompts), f"Question {i}: what does word {rng.randrange(1, 500)} of the passage mean?")
            for i in range(num)]


async def _one(client: httpx.AsyncClient, system: str, question: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    start, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


async def drive(url: str, reqs: list[tuple[str, str]], concurrency: int, max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    ttfts, tokens = [], []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker():
            while not queue.empty():
                system, question = queue.get_nowait()
                t, n = await _one(client, system, question, max_tokens)
                ttfts.append(t)
                tokens.append(n)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    q = statistics.quantiles(ttfts, n=100)
    return {"requests": len(ttfts), "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": q[98],
            "output_tokens_per_s": sum(tokens) / wall, "wall_s": wall}


def metric_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def wait_replicas(url: str, num: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        if metric_sum(text, "attnserve_replicas") >= num:
            return
        time.sleep(2)
    raise RuntimeError(f"{num} replicas did not come up")


def run_system(system: str, args, reqs, warm, out: Path) -> dict:
    replicas = 1 if system == "single" else 2
    pool = args.kv_cache_memory_bytes * (2 if system == "single" else 1)
    port = free_port()
    extra = ["--dtype", args.dtype, "--replicas", str(replicas), "--router", "pow2" if system == "pow2" else "cache",
             "--kv-cache-memory", str(pool), "--num-cpus", str(2 / replicas)]
    url = f"http://127.0.0.1:{port}"
    with running(attnserve_cmd({"default": "default"}, port, extra), url, out / system / "server.log"):
        wait_replicas(url, replicas)
        asyncio.run(drive(url, warm, 2, 4))  # compiles nothing new; loads each replica's first pages
        before = httpx.get(f"{url}/metrics", timeout=30).text
        result = asyncio.run(drive(url, reqs, args.concurrency, args.max_tokens))
        time.sleep(2.5)  # replicas push their counters every second
        after = httpx.get(f"{url}/metrics", timeout=30).text
    hits = metric_sum(after, "attnserve_prefix_cache_hits_total") - metric_sum(before, "attnserve_prefix_cache_hits_total")
    looked = (metric_sum(after, "attnserve_prefix_cache_queries_total")
              - metric_sum(before, "attnserve_prefix_cache_queries_total"))
    return {**result, "hit_rate": hits / looked if looked else 0.0, "replicas": replicas, "kv_cache_memory": pool}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dtype", default="auto", help="the engine's --dtype (auto: bf16 where the CPU computes it natively)")
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=700, help="about 1,000 tokens with the default tokenizer")
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="100MiB", help="per replica of the two; about 4,500 tokens in bf16")
    p.add_argument("--out", default=str(ROOT / "loadtests" / "out" / "routing"))
    p.add_argument("--json")
    args = p.parse_args(argv)
    from server.engine.config import parse_size

    args.kv_cache_memory_bytes = parse_size(args.kv_cache_memory)
    prompts = system_prompts(args.num_prefixes, args.prefix_words)
    reqs = requests(prompts, args.requests)
    warm = [("Say hi.", "Hi?"), ("Say hello.", "Hello?")]
    results = {}
    for system in args.systems.split(","):
        results[system] = run_system(system, args, reqs, warm, Path(args.out))
        print(f"{system}: {json.dumps(results[system])}", flush=True)
    print(f"\n{args.requests} chat requests over {args.num_prefixes} system prompts of {args.prefix_words} words, "
          f"{args.concurrency} concurrent, {args.max_tokens} tokens, KV {args.kv_cache_memory} per replica")
    print(f"{'system':8} {'replicas':>8} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>10}")
    for system, r in results.items():
        print(f"{system:8} {r['replicas']:8d} {r['hit_rate']:9.3f} {r['ttft_p50_s']:9.3f} {r['ttft_p99_s']:9.3f} "
              f"{r['output_tokens_per_s']:10.1f}")
    if "cache" in results and "pow2" in results:
        c, d = results["cache"], results["pow2"]
        print(f"cache vs pow2: TTFT p50 {d['ttft_p50_s'] / c['ttft_p50_s']:.2f}x better, "
              f"hit rate {c['hit_rate']:.3f} vs {d['hit_rate']:.3f}")
    if "cache" in results and "single" in results and results["single"]["hit_rate"]:
        print(f"cache hit rate / single replica's: {results['cache']['hit_rate'] / results['single']['hit_rate']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
