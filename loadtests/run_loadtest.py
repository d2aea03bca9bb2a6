"""One-command load test: locust headless against a URL (or a server it starts), then a summary
and PNG plots.

    python loadtests/run_loadtest.py --users 16 --spawn-rate 4 --duration 60s            # starts `attnserve serve`
    python loadtests/run_loadtest.py --url http://127.0.0.1:8000 --scenario mixed --models default,mha,mqa

Writes into --out: locust's CSVs (locust_stats.csv, locust_stats_history.csv, ...), summary.json,
throughput.png, latency.png and (from the server's /dashboard/data) kv_bytes.png.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from loadtests.servers import BIN, ROOT, attnserve_cmd, free_port, running  # noqa: E402
from loadtests.workload import DEFAULT_WORKLOAD, ensure  # noqa: E402

SCENARIOS = {"chat": ["ChatStreamUser"], "completion": ["CompletionUser"], "shared": ["SharedPrefixUser"],
             "long": ["LongPromptUser"], "mixed": ["MixedModelUser"],
             "all": ["ChatStreamUser", "CompletionUser", "SharedPrefixUser", "LongPromptUser", "MixedModelUser"]}
DEFAULT_SERVE = {"default": "default", "mha": "smollm2-135m-instruct-mha", "mqa": "smollm2-135m-instruct-mqa"}


def run_locust(url: str, out: Path, users: int, spawn_rate: float, duration: str, classes: list[str],
               models: list[str], workload: Path, until: Callable[[], bool] | None = None,
               locustfile: Path = ROOT / "loadtests" / "locustfile.py", options: list[str] | None = None,
               stop_timeout: int = 60) -> int:
    """locust headless for `duration`, or until `until()` holds (then SIGTERM: locust stops its users,
    letting each finish its request within `stop_timeout` s, and writes its CSVs as at the end).
    `options`: the locustfile's own command-line options."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(BIN / "locust"), "-f", str(locustfile), "--headless", "--users", str(users),
           "--spawn-rate", str(spawn_rate), "--run-time", duration, "--host", url, "--csv", str(out / "locust"),
           "--csv-full-history", "--stop-timeout", str(stop_timeout), "--only-summary", *(options or []), *classes]
    env = {**os.environ, "ATTNSERVE_WORKLOAD": str(workload), "ATTNSERVE_MODELS": ",".join(models)}
    with (out / "locust.log").open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        while until is not None and proc.poll() is None:
            if until():
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.5)
        return proc.wait()


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def summarize(out: Path, duration_s: float) -> dict:
    rows = _rows(out / "locust_stats.csv")
    http = [r for r in rows if r["Type"] in ("POST", "GET")]
    by_type = {r["Type"]: r for r in rows if r["Name"] != "Aggregated" and r["Type"] in ("TTFT", "ITL", "TOKENS")}
    for kind in ("TTFT", "ITL", "TOKENS"):  # several names per kind: merge counts, weight percentiles by count
        same = [r for r in rows if r["Type"] == kind]
        if len(same) > 1:
            by_type[kind] = _merge(same)
    requests = sum(int(r["Request Count"]) for r in http)
    failures = sum(int(r["Failure Count"]) for r in http)
    tokens = by_type.get("TOKENS")
    out_tokens = int(float(tokens["Average Content Size"]) * int(tokens["Request Count"])) if tokens else 0

    def pct(kind: str, p: str) -> float | None:
        r = by_type.get(kind)
        return float(r[p]) / 1000 if r and r[p] not in ("N/A", "") else None
    return {"requests": requests, "failures": failures, "errors": failures, "duration_s": duration_s,
            "requests_per_s": requests / duration_s, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / duration_s,
            "ttft_p50_s": pct("TTFT", "50%"), "ttft_p99_s": pct("TTFT", "99%"),
            "itl_p50_s": pct("ITL", "50%"), "itl_p99_s": pct("ITL", "99%")}


def _merge(rows: list[dict]) -> dict:
    count = sum(int(r["Request Count"]) for r in rows)
    merged = {"Request Count": str(count)}
    for key in ("Average Content Size", "50%", "99%"):
        vals = [(float(r[key]), int(r["Request Count"])) for r in rows if r[key] not in ("N/A", "")]
        merged[key] = str(sum(v * n for v, n in vals) / max(count, 1)) if vals else "N/A"
    return merged


def plot(out: Path, url: str | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = _rows(out / "locust_stats_history.csv")
    t0 = min(int(r["Timestamp"]) for r in hist)
    series: dict[str, dict[int, float]] = defaultdict(dict)
    tokens_total: dict[int, float] = {}
    for r in hist:
        t = int(r["Timestamp"]) - t0
        if r["Type"] in ("POST", "GET"):
            series["requests/s"][t] = series["requests/s"].get(t, 0.0) + float(r["Requests/s"])
        elif r["Type"] == "TOKENS":
            size = float(r.get("Total Average Content Size") or 0)
            tokens_total[t] = tokens_total.get(t, 0.0) + size * int(r["Total Request Count"])
        if r["Type"] in ("TTFT", "ITL") and r["50%"] not in ("N/A", ""):
            series[f"{r['Type']} p50 ({r['Name']})"][t] = float(r["50%"]) / 1000
            series[f"{r['Type']} p99 ({r['Name']})"][t] = float(r["99%"]) / 1000
    written = []
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = sorted(series["requests/s"])
    ax.plot(xs, [series["requests/s"][x] for x in xs], label="requests/s")
    ts = sorted(tokens_total)
    if len(ts) > 1:  # tokens are counted when a request ends: smooth over a 10 s window
        window = [next(a for a in ts if a >= t - 10) for t in ts]
        rate = [(tokens_total[t] - tokens_total[a]) / max(t - a, 1) for t, a in zip(ts, window)]
        ax2 = ax.twinx()
        ax2.plot(ts, rate, color="tab:orange", label="output tokens/s (10 s window)")
        ax2.set_ylabel("output tokens/s")
        ax2.legend(loc="upper right")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests/s")
    ax.legend(loc="upper left")
    ax.set_title("Throughput over time")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    written.append(out / "throughput.png")
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("TTFT", "ITL")):
        for name, pts in sorted(series.items()):
            if name.startswith(kind):
                xs = sorted(pts)
                ax.plot(xs, [pts[x] for x in xs], label=name, linestyle="-" if "p50" in name else "--")
        ax.set_title(f"{kind} percentiles over time")
        ax.set_xlabel("seconds")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=100)
    written.append(out / "latency.png")
    plt.close(fig)
    if url:
        data = httpx.get(f"{url}/dashboard/data", timeout=30).json()
        (out / "dashboard_data.json").write_text(json.dumps(data))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in data["models"]:
            pts = [(r["seq_len"], r["kv_bytes"]) for r in m["requests"] if r["kv_bytes"]]
            if pts:
                ax.scatter(*zip(*pts), s=10, label=f"{m['model']} ({m['attention'].upper()}, {m['kv_heads']} kv)")
        ax.set_xlabel("prompt + output tokens")
        ax.set_ylabel("peak KV-cache bytes per request")
        ax.set_title("KV bytes per request vs sequence length")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "kv_bytes.png", dpi=100)
        written.append(out / "kv_bytes.png")
        plt.close(fig)
    return written


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="server to test; default: start `attnserve serve` on a free port")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--spawn-rate", type=float, default=4)
    ap.add_argument("--duration", default="60s", help="locust --run-time, e.g. 20s or 2m")
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="chat")
    ap.add_argument("--models", help="comma-separated model names to request (default: default, or all served for mixed)")
    ap.add_argument("--workload", help="JSONL from loadtests/workload.py (built if missing)")
    ap.add_argument("--out", help="output folder (default loadtests/out/run-<time>)")
    ap.add_argument("--serve-args", default="", help="extra args for `attnserve serve` when it is started here")
    args = ap.parse_args(argv)
    out = Path(args.out or ROOT / "loadtests" / "out" / time.strftime("run-%Y%m%d-%H%M%S"))
    workload = ensure(Path(args.workload) if args.workload else DEFAULT_WORKLOAD)
    served = DEFAULT_SERVE if args.scenario in ("mixed", "all") else {"default": "default"}
    models = args.models.split(",") if args.models else list(served)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            port = free_port()
            url = stack.enter_context(running(attnserve_cmd(served, port, args.serve_args.split()),
                                              f"http://127.0.0.1:{port}", out / "server.log"))
        start = time.monotonic()
        code = run_locust(url, out, args.users, args.spawn_rate, args.duration, SCENARIOS[args.scenario], models, workload)
        elapsed = time.monotonic() - start
        summary = summarize(out, min(elapsed, parse_duration(args.duration)))
        summary.update({"locust_exit_code": code, "scenario": args.scenario, "users": args.users, "url": url})
        plots = plot(out, url)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print("wrote", ", ".join(str(p) for p in [out / "summary.json", *plots]))
    return summary


if __name__ == "__main__":
    main()
