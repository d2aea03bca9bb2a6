"""Overload: far more concurrent requests than the KV pool holds, against a bounded waiting queue.

    attnserve serve --num-blocks 48 --max-waiting 16 ...   then
    python loadtests/overload.py --url http://127.0.0.1:8000 --model default --concurrency 200

Every request must either complete (preemption and re-admission do their job) or be refused
with 429 / 503 and a Retry-After header; replica memory must stay bounded. Prints a JSON report
with the p50 / p99 latency of admitted requests; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from loadtests.abort_storm import gauges  # noqa: E402


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int, stream: bool,
              headers: dict) -> tuple[str, float]:
    body = {"model": model, "prompt": f"request {i}: " + "tell me more " * (1 + i % 7), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    start = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        text = (await r.aread()).decode()
        elapsed = time.monotonic() - start
        if r.status_code in (429, 503):
            return (f"refused-{r.status_code}" if r.headers.get("retry-after") else f"no-retry-after-{r.status_code}"), elapsed
        if r.status_code != 200:
            return f"http-{r.status_code}", elapsed
        if stream and (not text.rstrip().endswith("data: [DONE]") or '"error"' in text):
            return "stream-error", elapsed
        return "completed", elapsed


def settled_gauges(url: str, model: str, before: dict, num_finished: int, timeout_s: float = 10.0) -> dict:
    """The gauges once the replicas have reported `num_finished` more finished requests.

    NOTE: replicas push their counters every second (server/deployment.py REPORT_PERIOD_S): read
    right after a short run, /metrics can still lack its last second (preemptions read 0)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = gauges(url, model)
        done = after.get("attnserve_requests_total", 0.0) - before.get("attnserve_requests_total", 0.0)
        if done >= num_finished or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def run(url: str, model: str, concurrency: int = 200, max_tokens: int = 32, memory_bound_bytes: float = 512 * 2**20,
        api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    before = gauges(url, model)
    peak = {"memory": before.get("attnserve_replica_resident_memory_bytes", 0.0), "waiting": 0.0, "running": 0.0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            g = gauges(url, model)
            peak["memory"] = max(peak["memory"], g.get("attnserve_replica_resident_memory_bytes", 0.0))
            peak["waiting"] = max(peak["waiting"], g.get("attnserve_requests_waiting", 0.0))
            peak["running"] = max(peak["running"], g.get("attnserve_requests_running", 0.0))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def main() -> list[tuple[str, float]]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 10)) as client:
            return await asyncio.gather(*(one(client, url, model, i, max_tokens, i % 2 == 0, headers)
                                          for i in range(concurrency)))
    start = time.monotonic()
    results = asyncio.run(main())
    done.set()
    sampler.join()
    outcomes: dict[str, int] = {}
    for kind, _ in results:
        outcomes[kind] = outcomes.get(kind, 0) + 1
    admitted = sorted(t for kind, t in results if kind == "completed")
    growth = peak["memory"] - before.get("attnserve_replica_resident_memory_bytes", 0.0)
    after = settled_gauges(url, model, before, outcomes.get("completed", 0))
    report = {
        "concurrency": concurrency, "seconds": round(time.monotonic() - start, 1), "outcomes": outcomes,
        "admitted_p50_s": statistics.median(admitted) if admitted else None,
        "admitted_p99_s": admitted[min(len(admitted) - 1, int(0.99 * len(admitted)))] if admitted else None,
        "peak_waiting": peak["waiting"], "peak_running": peak["running"],
        "replica_memory_before_mb": round(before.get("attnserve_replica_resident_memory_bytes", 0.0) / 2**20, 1),
        "replica_memory_peak_mb": round(peak["memory"] / 2**20, 1), "replica_memory_growth_mb": round(growth / 2**20, 1),
        "preemptions": after.get("attnserve_preemptions_total", 0.0) - before.get("attnserve_preemptions_total", 0.0),
    }
    report["ok"] = (set(outcomes) <= {"completed", "refused-429", "refused-503"} and outcomes.get("completed", 0) > 0
                    and growth < memory_bound_bytes)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--api-key")
    args = ap.parse_args(argv)
    report = run(args.url, args.model, args.concurrency, args.max_tokens, api_key=args.api_key)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
