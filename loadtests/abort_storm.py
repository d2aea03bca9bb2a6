"""Abort storm: many streaming requests, a random half of them dropped mid-stream.

    python loadtests/abort_storm.py --url http://127.0.0.1:8000 --model default --requests 1000

Afterwards every KV block must be free and no request left in any engine (read from /metrics),
and no completed request may have seen a 5xx. Prints a JSON report; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def gauges(url: str, model: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.labels.get("model") != model:
                continue
            key = s.name + (f"[{s.labels['state']}]" if "state" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, drop: bool, max_tokens: int,
              headers: dict) -> str:
    """'completed', 'dropped', or 'http-<status>' / 'error:<text>'."""
    # events, not tokens: under load the server coalesces tokens, so a stream may have fewer events than
    # tokens. A stream to drop asks for twice the tokens and is cut within its first eighth: it would have
    # to pack eight tokens per event on average to finish first
    body = {"model": model, "prompt": f"{rng.randrange(10**6)} " * rng.randint(1, 20),
            "max_tokens": 2 * max_tokens if drop else max_tokens, "temperature": 0.8, "stream": True,
            "ignore_eos": True}
    cut_after = rng.randint(1, max(1, max_tokens // 4)) if drop else None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return f"http-{r.status_code}"
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line[:20]:
                    return "error:" + line[6:200]
                if line.startswith("data: {"):
                    seen += 1
                    if cut_after is not None and seen > cut_after:
                        return "dropped"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "completed"
            return "error:stream ended without [DONE]"
    except httpx.HTTPError as e:
        return f"error:{type(e).__name__}"


async def storm(url: str, model: str, requests: int, concurrency: int, drop_fraction: float, max_tokens: int,
                seed: int, headers: dict) -> dict[str, int]:
    rng = random.Random(seed)
    drops = set(rng.sample(range(requests), int(requests * drop_fraction)))
    sem = asyncio.Semaphore(concurrency)
    outcomes: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=120) as client:
        async def run(i: int) -> None:
            async with sem:
                result = await one(client, url, model, random.Random(seed * 100003 + i), i in drops, max_tokens, headers)
            outcomes[result] = outcomes.get(result, 0) + 1
        await asyncio.gather(*(run(i) for i in range(requests)))
    return outcomes


def run(url: str, model: str, requests: int = 1000, concurrency: int = 32, drop_fraction: float = 0.5,
        max_tokens: int = 64, seed: int = 0, settle_s: float = 30.0, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    outcomes = asyncio.run(storm(url, model, requests, concurrency, drop_fraction, max_tokens, seed, headers))
    elapsed = time.monotonic() - start
    deadline, g = time.monotonic() + settle_s, {}
    while time.monotonic() < deadline:  # replicas report every second
        g = gauges(url, model)
        if g.get("attnserve_kv_blocks[used]") == 0 and g.get("attnserve_requests_running") == 0 \
                and g.get("attnserve_requests_waiting") == 0:
            break
        time.sleep(0.5)
    server_errors = sum(n for k, n in outcomes.items() if k.startswith("http-5"))
    report = {"requests": requests, "concurrency": concurrency, "seconds": round(elapsed, 1), "outcomes": outcomes,
              "kv_blocks_used_after": g.get("attnserve_kv_blocks[used]"), "kv_blocks_total": g.get("attnserve_kv_blocks[total]"),
              "running_after": g.get("attnserve_requests_running"), "waiting_after": g.get("attnserve_requests_waiting"),
              "server_errors": server_errors}
    # a request picked for dropping that ends before its cut point simply completes
    report["ok"] = (report["kv_blocks_used_after"] == 0 and report["running_after"] == 0 and report["waiting_after"] == 0
                    and server_errors == 0 and outcomes.get("completed", 0) + outcomes.get("dropped", 0) == requests
                    and outcomes.get("dropped", 0) >= 0.9 * int(requests * drop_fraction))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--drop-fraction", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key")
    args = ap.parse_args(argv)
    report = run(args.url, args.model, args.requests, args.concurrency, args.drop_fraction, args.max_tokens, args.seed,
                 api_key=args.api_key)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
