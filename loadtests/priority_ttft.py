"""Interactive TTFT beside saturating batch traffic: what `--scheduling-policy priority` buys.

    attnserve serve --scheduling-policy priority ...   then
    python loadtests/priority_ttft.py --url http://127.0.0.1:8000 --batch-priority 10
    attnserve serve ...                                (fcfs, the default) then
    python loadtests/priority_ttft.py --url http://127.0.0.1:8000 --batch-priority 0

`--batch` streams of long completions keep the engine saturated (each replaced as it ends) at
`--batch-priority`; meanwhile one short streamed chat request at priority 0 every `--interval`
seconds measures its time to the first content token. Prints the interactive TTFT p50 / p90 and the
batch tokens/s as JSON. Compare the two runs' p50 (issue 38's target: priority's <= 0.3x fcfs's).
A fcfs server refuses a priority other than 0, so its run sends 0 everywhere.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

BATCH_PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4
QUESTION = "What is the capital of France?"


async def first_token_s(client: httpx.AsyncClient, url: str, model: str) -> float | None:
    """Seconds from sending a priority-0 chat request to its first content delta; None if it failed."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "stream": True,
            "temperature": 0, "priority": 0}
    start = time.monotonic()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if any(c["delta"].get("content") for c in json.loads(line[len("data: "):]).get("choices", [])):
                return time.monotonic() - start
    return None


async def batch_stream(client: httpx.AsyncClient, url: str, model: str, priority: int, max_tokens: int,
                       tokens: list[int]) -> None:
    """One batch client: a long completion after another, until cancelled."""
    body = {"model": model, "prompt": BATCH_PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": priority}
    while True:
        r = await client.post(f"{url}/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"batch request failed: {r.status_code} {r.text[:200]}")
        tokens.append(r.json()["usage"]["completion_tokens"])


async def run(url: str, model: str, batch: int, batch_priority: int, max_tokens: int, interval: float,
              probes: int, warmup_s: float) -> dict:
    limits = httpx.Limits(max_connections=batch + probes + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tokens: list[int] = []
        workers = [asyncio.create_task(batch_stream(client, url, model, batch_priority, max_tokens, tokens))
                   for _ in range(batch)]
        await asyncio.sleep(warmup_s)  # the queue fills before the first probe
        start = time.monotonic()
        probes_done = []
        for _ in range(probes):
            probes_done.append(asyncio.create_task(first_token_s(client, url, model)))
            await asyncio.sleep(interval)
        ttfts = await asyncio.gather(*probes_done)
        elapsed = time.monotonic() - start
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    ok = sorted(t for t in ttfts if t is not None)
    return {"batch": batch, "batch_priority": batch_priority, "probes": probes, "failed_probes": probes - len(ok),
            "interactive_ttft_p50_s": statistics.median(ok) if ok else None,
            "interactive_ttft_p90_s": ok[min(len(ok) - 1, int(0.9 * len(ok)))] if ok else None,
            "batch_tokens_per_s": round(sum(tokens) / elapsed, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=32, help="concurrent batch clients (more than --max-num-seqs)")
    ap.add_argument("--batch-priority", type=int, default=10, help="0 against a fcfs server")
    ap.add_argument("--max-tokens", type=int, default=128, help="per batch request")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between interactive requests")
    ap.add_argument("--probes", type=int, default=20, help="interactive requests")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of batch traffic before the first probe")
    args = ap.parse_args(argv)
    report = asyncio.run(run(args.url, args.model, args.batch, args.batch_priority, args.max_tokens, args.interval,
                             args.probes, args.warmup))
    print(json.dumps(report, indent=2))
    return 0 if report["failed_probes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
