"""Tensor and pipeline parallelism against one process, on the same machine, in one run.

    python loadtests/bench_parallel.py --repeats 3

Forms (default: the embedded SmolLM2-135M as served, Q4_1 weights): `tp1`, the whole model in this
process with --threads threads (its fastest path, the native decoder); `tp2`, its heads and MLP
features over 2 Ray workers of one thread each (one node; each rank runs the native decoder too,
all-reducing through shared memory); `pp2`, its layers over 2 stages of one
thread each, one on each of two Ray nodes started on this machine (`ray start`), several
micro-batches in flight. For each: batch-1 decode (ms per output token, after the first), and the
throughput of --batch concurrent requests (output tokens/s, prefill included), medians of
--repeats; for the sharded forms, the workers' own timers: milliseconds per step spent in
collectives (the shared-memory op's time, waiting for the other ranks included) and waiting for
stage-to-stage transfers. Ratio: this form against `tp1`, same run. `--address` runs on a cluster
of two or more nodes that is already up (KubeRay's, or a test's) instead of starting one;
`--enforce-eager` skips compiling the step (a quick check of the script, not a figure to report).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()  # NOTE: before torch
import torch  # noqa: E402

from loadtests.bench_engine import make_prompts  # noqa: E402
from loadtests.engine_timing import save_json  # noqa: E402
from loadtests.servers import BIN, free_port  # noqa: E402
from server.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

FORMS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


@contextmanager
def two_nodes(cpus_per_node: int, address: str | None = None):
    """Two Ray nodes on this machine (a head and one more), this process their driver; afterwards
    every process of that cluster (and only of it: its temp dir names them) is killed. With
    `address`, that cluster's driver instead, and it is left as found."""
    import ray

    if address:
        ray.init(address=address, log_to_driver=False)
        try:
            assert sum(n["Alive"] for n in ray.nodes()) >= 2, f"{address}: pp2 needs two live nodes"
            yield
        finally:
            ray.shutdown()
        return
    temp_dir = tempfile.mkdtemp(prefix="attnserve-bench-", dir="/tmp")
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    start = [str(BIN / "ray"), "start", "--disable-usage-stats", "--num-cpus", str(cpus_per_node)]
    try:
        subprocess.run([*start, "--head", "--port", address.rsplit(":", 1)[1], "--temp-dir", temp_dir,
                        "--include-dashboard", "false"], env=env, check=True, capture_output=True, timeout=120)
        subprocess.run([*start, "--address", address, "--node-manager-port", str(free_port()),
                        "--object-manager-port", str(free_port()), "--min-worker-port", "23000",
                        "--max-worker-port", "23999"], env=env, check=True, capture_output=True, timeout=120)
        ray.init(address=address, log_to_driver=False)
        assert len(ray.nodes()) == 2
        yield
    finally:
        ray.shutdown()
        marks = (temp_dir.encode(), address.encode())  # NOTE: its agents name only the GCS address
        for pid in Path("/proc").iterdir():
            try:
                if pid.name.isdigit() and any(m in (pid / "cmdline").read_bytes() for m in marks):
                    os.kill(int(pid.name), signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[float]]]:
    """Wall seconds for every prompt to finish, and per request the times its tokens arrived."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    arrivals: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    while engine.has_unfinished():
        for o in engine.step():
            arrivals.setdefault(o.request_id, []).extend([time.perf_counter()] * len(o.new_token_ids))
    engine.kv.pool.reset_prefix_cache()
    return time.perf_counter() - start, list(arrivals.values())


def bench_form(args, form: str) -> dict:
    tp, pp = FORMS[form]
    sharded = tp * pp > 1
    if not sharded:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=64, max_num_batched_tokens=1024,
                                    tensor_parallel_size=tp, pipeline_parallel_size=pp, worker_cpus=0.5,
                                    num_threads=1 if sharded else args.threads, enforce_eager=args.enforce_eager))
    vocab = engine.model_config.vocab_size
    one = make_prompts(1, args.prompt_len, args.prompt_len, vocab, seed=1)
    batch = make_prompts(args.batch, args.prompt_len, args.prompt_len, vocab, seed=2)
    run(engine, one, 4)  # warm-up
    latency, throughput = [], []
    for _ in range(args.repeats):
        _, (times,) = run(engine, one, args.max_tokens)
        latency.append(1000 * (times[-1] - times[0]) / (len(times) - 1))
        seconds, _ = run(engine, batch, args.max_tokens)
        throughput.append(args.batch * args.max_tokens / seconds)
    result = {"ms_per_token_b1": statistics.median(latency), "tokens_per_s": statistics.median(throughput),
              "step": engine.runner.step, "workers": [w.pid for w in engine.info.workers]}
    if sharded:
        for name, prompts in (("comm_b1", one), (f"comm_b{args.batch}", batch)):
            before = engine.executor.comm_stats()
            run(engine, prompts, args.max_tokens)
            result[name] = comm_per_step(before, engine.executor.comm_stats())
        engine.executor.shutdown()
    return result


def comm_per_step(before: list[dict], after: list[dict]) -> dict:
    """Per rank, milliseconds per step of its own step time and of communication in it (collectives,
    waiting for the previous stage, sends); the table shows the rank that communicated longest."""
    ranks = []
    for a, b in zip(before, after):
        steps = max(1, b["steps"] - a["steps"])
        ms = {k: 1000 * (b[k] - a[k]) / steps for k in ("step_s", "collective_s", "recv_s", "send_s")}
        ranks.append({"rank": b["rank"], "steps": steps, "step_ms": ms["step_s"], "collective_ms": ms["collective_s"],
                      "recv_ms": ms["recv_s"], "send_ms": ms["send_s"],
                      "comm_ms": ms["collective_s"] + ms["recv_s"] + ms["send_s"]})
    return {"ms_per_step": max(r["comm_ms"] for r in ranks), "ranks": ranks}


def print_table(args, results: dict) -> None:
    base = results["tp1"]
    print(f"\nmodel {args.model}; prompts of {args.prompt_len} tokens, {args.max_tokens} output tokens; "
          f"tp1 with {args.threads} threads, sharded forms one thread per rank; medians of {args.repeats}; "
          f"ratio x = this / tp1 (>1: better)")
    print(f"{'form':<8} {'step':>9} {'b1 ms/tok':>10} {'x':>5} {f'b{args.batch} tok/s':>11} {'x':>5} "
          f"{'comm ms/step b1':>16} {f'b{args.batch}':>6}")
    for form, r in results.items():
        comm = (f"{r['comm_b1']['ms_per_step']:16.2f} {r[f'comm_b{args.batch}']['ms_per_step']:6.2f}"
                if "comm_b1" in r else f"{'-':>16} {'-':>6}")
        print(f"{form:<8} {r['step']:>9} {r['ms_per_token_b1']:10.2f} {base['ms_per_token_b1'] / r['ms_per_token_b1']:5.2f} "
              f"{r['tokens_per_s']:11.1f} {r['tokens_per_s'] / base['tokens_per_s']:5.2f} {comm}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--forms", default="tp1,tp2,pp2")
    ap.add_argument("--threads", type=int, default=2, help="tp1's torch threads")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--address", help="a running Ray cluster of two or more nodes (default: start one here)")
    ap.add_argument("--enforce-eager", action="store_true", help="no compiled step (quick checks)")
    args = ap.parse_args(argv)
    forms = args.forms.split(",")
    if forms[0] != "tp1" or set(forms) - set(FORMS):
        raise SystemExit(f"--forms: tp1 first (the ratio's base), then any of {', '.join(FORMS)}")
    with two_nodes(cpus_per_node=1, address=args.address):
        results = {form: bench_form(args, form) for form in forms}
    print_table(args, results)
    save_json(args, results)
    return results


if __name__ == "__main__":
    main()
