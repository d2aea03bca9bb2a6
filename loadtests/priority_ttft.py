"""Issue 38's priority target under locust: a priority-0 interactive request's time to first token beside
saturating batch traffic, `--scheduling-policy priority` against fcfs (target: p50 <= 0.3x fcfs's).

    python loadtests/priority_ttft.py --repeats 3 --warmup 20 --duration 60

Each run starts `attnserve serve --max-num-seqs 8 --scheduling-policy <policy>` on a free port and runs
loadtests/priority_locustfile.py headless against it: --batch-users streams of --batch-tokens-token
completions (ignore_eos) back to back, at --batch-priority under priority and at 0 under fcfs (which
refuses any other), beside --interactive-users that each send a short streamed chat request at priority 0
every --interval s. The stats are reset after --warmup s; locust stops --duration s later without waiting
for requests in flight (a probe still waiting then goes uncounted: fcfs's p50 leans low, the ratio high).
The policies alternate over --repeats pairs (priority first in odd pairs, fcfs first in even ones). Prints
a markdown table: interactive TTFT p50 / p90 and batch output tok/s per policy, and priority / fcfs, per
pair and as medians over the pairs. Locust's CSVs, the server logs and results.json go to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests.run_loadtest import _rows, run_locust  # noqa: E402
from loadtests.servers import ROOT, attnserve_cmd, free_port, running  # noqa: E402
from loadtests.workload import DEFAULT_WORKLOAD  # noqa: E402

LOCUSTFILE = ROOT / "loadtests" / "priority_locustfile.py"
POLICIES = ("priority", "fcfs")
METRICS = (("ttft_p50_s", "TTFT p50 s", ".2f"), ("ttft_p90_s", "TTFT p90 s", ".2f"),
           ("batch_tokens_per_s", "batch tok/s", ".1f"))


def read_run(out: Path, duration_s: float) -> dict:
    """The measured window's figures from locust's stats CSV (times in ms, rounded by locust)."""
    rows = {(r["Type"], r["Name"]): r for r in _rows(out / "locust_stats.csv")}
    ttft = rows.get(("TTFT", "interactive"))
    chunks = [r for r in (rows.get(("TTFT", "batch")), rows.get(("ITL", "batch"))) if r]  # length: tokens brought

    def seconds(p: str) -> float | None:
        return float(ttft[p]) / 1000 if ttft and ttft[p] not in ("N/A", "") else None
    return {"ttft_p50_s": seconds("50%"), "ttft_p90_s": seconds("90%"),
            "probes": int(ttft["Request Count"]) if ttft else 0,
            "batch_tokens_per_s": sum(float(r["Average Content Size"]) * int(r["Request Count"]) for r in chunks)
                                  / duration_s,
            "failures": sum(int(r["Failure Count"]) for (kind, _), r in rows.items() if kind == "POST")}


def run_policy(policy: str, args, out: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    batch_priority = args.batch_priority if policy == "priority" else 0  # NOTE: fcfs answers any other with a 400
    serve = ["--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", policy, *args.serve_args.split()]
    options = ["--batch-users", str(args.batch_users), "--interactive-users", str(args.interactive_users),
               "--batch-priority", str(batch_priority), "--batch-tokens", str(args.batch_tokens),
               "--interval", str(args.interval), "--warmup", str(args.warmup)]
    users = args.batch_users + args.interactive_users
    with running(attnserve_cmd({"default": args.model}, port, serve), url, out / "server.log"):
        code = run_locust(url, out, users, users, f"{args.warmup + args.duration}s", ["BatchUser", "InteractiveUser"],
                          ["default"], DEFAULT_WORKLOAD, locustfile=LOCUSTFILE, options=options, stop_timeout=0)
    return {"policy": policy, "batch_priority": batch_priority, **read_run(out, args.duration),
            "locust_exit_code": code}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(values: tuple[float | None, ...]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _cells(values: list[float | None]) -> str:
    formats = [f for _, _, fmt in METRICS for f in (fmt, fmt, ".2f")]
    return " | ".join("n/a" if v is None else format(v, f) for v, f in zip(values, formats))


def table(pairs: list[dict[str, dict]]) -> str:
    """Markdown: per pair and median over pairs, each metric for priority, fcfs and priority / fcfs."""
    head = ["pair", *(f"{label} {col}" for _, label, _ in METRICS for col in ("priority", "fcfs", "ratio")),
            "probes priority / fcfs", "failures"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    values = [[v for key, _, _ in METRICS for v in (pair["priority"][key], pair["fcfs"][key],
                                                    _ratio(pair["priority"][key], pair["fcfs"][key]))]
              for pair in pairs]  # [pair][metric x (priority, fcfs, ratio)]
    for n, (pair, row) in enumerate(zip(pairs, values), 1):
        p, f = pair["priority"], pair["fcfs"]
        lines.append(f"| {n} | {_cells(row)} | {p['probes']} / {f['probes']} | {p['failures'] + f['failures']} |")
    lines.append(f"| median | {_cells([_median(column) for column in zip(*values)])} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="served as `default`")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="small, so that the batch users saturate it")
    ap.add_argument("--batch-users", type=int, default=24, help="more than --max-num-seqs")
    ap.add_argument("--batch-priority", type=int, default=10, help="under priority (fcfs runs send 0)")
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--interactive-users", type=int, default=4)
    ap.add_argument("--interval", type=float, default=8.0, help="seconds between one interactive user's requests")
    ap.add_argument("--warmup", type=int, default=20, help="seconds of load before the measured window")
    ap.add_argument("--duration", type=int, default=60, help="seconds measured")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs (one per policy)")
    ap.add_argument("--serve-args", default="", help="more `attnserve serve` args for both servers")
    ap.add_argument("--out", help="output folder (default loadtests/out/priority-<time>)")
    args = ap.parse_args(argv)
    out = Path(args.out or ROOT / "loadtests" / "out" / time.strftime("priority-%Y%m%d-%H%M%S"))
    pairs: list[dict[str, dict]] = []
    for i in range(args.repeats):
        pair = {}
        for policy in POLICIES if i % 2 == 0 else POLICIES[::-1]:
            pair[policy] = run_policy(policy, args, out / f"pair{i + 1}-{policy}")
            print(json.dumps({"pair": i + 1, **pair[policy]}), flush=True)
        pairs.append(pair)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "pairs": pairs}, indent=2))
    print(f"\n{args.batch_users} batch users ({args.batch_tokens} tokens, ignore_eos, priority {args.batch_priority} "
          f"under priority, 0 under fcfs), {args.interactive_users} interactive users (priority 0, every "
          f"{args.interval:g} s each), --max-num-seqs {args.max_num_seqs}, {args.warmup} s warm-up, "
          f"{args.duration} s measured, {args.repeats} pairs; ratio = priority / fcfs (median row: the median of the "
          f"pairs' ratios)\n")
    print(table(pairs))
    runs = [r for pair in pairs for r in pair.values()]
    ok = all(r["probes"] and not r["failures"] and r["locust_exit_code"] == 0 for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
