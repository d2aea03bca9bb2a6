"""attnserve against `transformers serve` over HTTP, same machine, model, dtype, threads and
locust workload, one server at a time.

    python loadtests/compare_http.py --users 16 --duration 2m --json loadtests/out/compare.json

Systems: attnserve (`attnserve serve`), transformers_serve_cb (`transformers serve
--continuous-batching`: its paged attention) and transformers_serve (its default mode). The model
is the default SmolLM2-135M-Instruct as a safetensors directory (our converted cache), which
transformers loads natively. Prints requests/s, output tokens/s, TTFT p50/p99, ITL p50/p99, errors.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from loadtests.run_loadtest import run_locust, summarize  # noqa: E402
from loadtests.servers import BIN, ROOT, attnserve_cmd, free_port, running  # noqa: E402
from loadtests.workload import DEFAULT_WORKLOAD, ensure  # noqa: E402
from models.registry import resolve_model  # noqa: E402

SYSTEMS = ("attnserve", "transformers_serve_cb", "transformers_serve")
KEYS = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "errors")


def server(system: str, model_dir: Path, port: int, dtype: str, threads: int) -> tuple[list[str], str, dict]:
    """(command, model field for requests, env)."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if system == "attnserve":
        return attnserve_cmd({"default": str(model_dir)}, port, ["--dtype", dtype, "--threads", str(threads)]), "default", env
    cmd = [str(BIN / "transformers"), "serve", str(model_dir), "--device", "cpu", "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port)]
    if system == "transformers_serve_cb":
        cmd.append("--continuous-batching")
    return cmd, str(model_dir), env


def warm_up(url: str, model: str) -> None:
    """One request first: transformers serve loads and warms up on it (about 26 s here)."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]})
    r.raise_for_status()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="model name or directory (safetensors)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--spawn-rate", type=float, default=4)
    ap.add_argument("--duration", default="2m")
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=str(ROOT / "loadtests" / "out" / "compare"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    model_dir = resolve_model(args.model)
    workload = ensure(Path(args.workload))
    results = {}
    for system in args.systems.split(","):
        port = free_port()
        cmd, model, env = server(system, model_dir, port, args.dtype, args.threads)
        out = Path(args.out) / system
        url = f"http://127.0.0.1:{port}"
        with running(cmd, url, out / "server.log", env=env):
            warm_up(url, model)
            start = time.monotonic()
            code = run_locust(url, out, args.users, args.spawn_rate, args.duration, ["ChatStreamUser"], [model], workload)
            summary = summarize(out, time.monotonic() - start)
        summary["locust_exit_code"] = code
        results[system] = summary
        print(f"{system}: {json.dumps({k: summary[k] for k in KEYS})}", flush=True)
    print(f"\nmodel={model_dir} dtype={args.dtype} threads={args.threads} users={args.users} duration={args.duration}")
    print(f"{'system':<24}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
          f"{'errors':>8}{'tok/s x':>9}")
    ours = results.get("attnserve", {}).get("output_tokens_per_s")
    for name, r in results.items():
        ratio = f"{ours / r['output_tokens_per_s']:.2f}" if ours and r["output_tokens_per_s"] else "-"
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"  # noqa: E731
        print(f"{name:<24}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>11.1f}{fmt(r['ttft_p50_s']):>10}"
              f"{fmt(r['ttft_p99_s']):>10}{fmt(r['itl_p50_s']):>9}{fmt(r['itl_p99_s']):>9}{r['errors']:>8}{ratio:>9}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: {key: v[key] for key in KEYS} for k, v in results.items()}, indent=2))
    return results


if __name__ == "__main__":
    main()
