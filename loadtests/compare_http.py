"""attnserve against its peers over HTTP: same machine, model, dtype and threads, one server at a time.

    python loadtests/compare_http.py --users 16 --duration 2m --json loadtests/out/compare.json
    python loadtests/compare_http.py --mode burst --burst-requests 16 --prompt-tokens 200 --max-tokens 128 \\
        --bursts 3 --json loadtests/out/burst.json

Systems: attnserve (`attnserve serve`), vllm (`vllm serve` from .venv-peers, made by `make peers`,
both cores; skipped when that venv is missing), transformers_serve_cb (`transformers serve
--continuous-batching`: its paged attention) and transformers_serve (its default mode). The model
is the default SmolLM2-135M-Instruct as a safetensors directory (our converted cache), which
transformers and vLLM load natively.

--mode locust (default): locust's chat scenario (streaming); prints requests/s, output tokens/s,
TTFT p50/p99, ITL p50/p99, errors.
--mode burst: --burst-requests concurrent non-streaming completions of --prompt-tokens token ids
each, exactly --max-tokens greedy tokens (EOS ignored), --bursts times with new prompts (no prefix
cache hits across bursts); output tokens/s is the median over bursts. attnserve_inprocess runs the
same bursts through `LLMEngine` in a process of its own with `attnserve serve`'s engine settings:
attnserve HTTP / in-process is the serving efficiency. Systems: attnserve, attnserve_inprocess, vllm,
llama_server (llama.cpp's, `make peers`, with --burst-requests slots; --model a GGUF file:
    python loadtests/compare_http.py --mode burst --model .models/llama-3.2-1b/Q4_K_M/model.gguf \
        --systems attnserve,llama_server).
In both modes the last column is attnserve's output tokens/s over each system's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()  # NOTE: before torch; the servers it starts get the cap from the environment too
import httpx  # noqa: E402

from loadtests.burst import burst_prompts, http_bursts, inprocess_bursts  # noqa: E402
from loadtests.run_loadtest import run_locust, summarize  # noqa: E402
from loadtests.servers import BIN, PEERS_VENV, ROOT, attnserve_cmd, free_port, running, vllm_cmd  # noqa: E402
from loadtests.workload import DEFAULT_WORKLOAD, ensure  # noqa: E402
from models import load_tokenizer, resolve_model  # noqa: E402
from models.loader import serving_dtype  # noqa: E402
from models.native.cpu_path import DTYPES  # noqa: E402

SYSTEMS = ("attnserve", "vllm", "transformers_serve_cb", "transformers_serve")
BURST_SYSTEMS = ("attnserve", "attnserve_inprocess", "vllm", "llama_server")
LLAMA_SERVER = ROOT / ".peers" / "llama.cpp-native" / "bin" / "llama-server"  # `make peers`
# NOTE: burst_wall_s (burst mode) and serving_efficiency (burst, attnserve's row) are None where they don't apply
KEYS = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "errors",
        "burst_wall_s", "serving_efficiency")


def gguf_of(model: Path) -> Path | None:
    """The GGUF file a model is, or holds as model.gguf (what llama-server takes); None for safetensors."""
    if model.suffix == ".gguf":
        return model
    return model / "model.gguf" if (model / "model.gguf").exists() else None


def server(system: str, model_dir: Path, port: int, dtype: str, threads: int,
           peers_venv: Path = PEERS_VENV, slots: int = 16) -> tuple[list[str], str, dict]:
    """(command, model field for requests, env). llama_server: `slots` parallel sequences (-np), each with room
    for a burst's prompt and completion."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if system == "llama_server":
        return [str(LLAMA_SERVER), "-m", str(gguf_of(model_dir)), "-t", str(threads), "-np", str(slots),
                "-c", str(slots * 1024), "--host", "127.0.0.1", "--port", str(port), "--no-webui"], "default", {}
    if system == "attnserve":
        return attnserve_cmd({"default": str(model_dir)}, port, ["--dtype", dtype, "--threads", str(threads)]), "default", env
    if system == "vllm":  # NOTE: no OMP_NUM_THREADS: it would keep vLLM's frontend and engine core multi-threaded
        cmd, vllm_env = vllm_cmd(model_dir, port, dtype, threads, peers_venv)
        return cmd, "default", vllm_env
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


def burst_summary(walls: list[float], requests: int, max_tokens: int) -> dict:
    """KEYS for one system's bursts: medians over bursts; no TTFT or ITL without streaming."""
    rate = statistics.median(requests * max_tokens / w for w in walls)
    return {"requests_per_s": rate / max_tokens, "output_tokens_per_s": rate, "ttft_p50_s": None,
            "ttft_p99_s": None, "itl_p50_s": None, "itl_p99_s": None, "errors": 0, "burst_wall_s": walls}


def print_table(args, model_dir: Path, results: dict) -> None:
    if args.mode == "burst":
        print(f"\nmodel={model_dir} dtype={args.dtype} threads={args.threads} burst: {args.burst_requests} x "
              f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens, median of {args.bursts}")
    else:
        print(f"\nmodel={model_dir} dtype={args.dtype} threads={args.threads} users={args.users} "
              f"duration={args.duration}")
    print(f"{'system':<24}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
          f"{'errors':>8}{'tok/s x':>9}  {'burst wall s' if args.mode == 'burst' else ''}")
    ours = results.get("attnserve", {}).get("output_tokens_per_s")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"  # noqa: E731
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<24}skipped: {r['skipped']}")
            continue
        ratio = f"{ours / r['output_tokens_per_s']:.2f}" if ours and r["output_tokens_per_s"] else "-"
        walls = " ".join(f"{w:.2f}" for w in r.get("burst_wall_s") or [])
        print(f"{name:<24}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>11.1f}{fmt(r['ttft_p50_s']):>10}"
              f"{fmt(r['ttft_p99_s']):>10}{fmt(r['itl_p50_s']):>9}{fmt(r['itl_p99_s']):>9}{r['errors']:>8}{ratio:>9}"
              f"  {walls}".rstrip())
    efficiency = results.get("attnserve", {}).get("serving_efficiency")
    if efficiency:
        print(f"serving efficiency (attnserve HTTP / in-process engine): {efficiency:.2f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["locust", "burst"], default="locust")
    ap.add_argument("--model", default="default", help="model name or directory (safetensors)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: what the engine chooses on this CPU")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--users", type=int, default=16, help="locust mode")
    ap.add_argument("--spawn-rate", type=float, default=4, help="locust mode")
    ap.add_argument("--duration", default="2m", help="locust mode")
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="locust mode")
    ap.add_argument("--burst-requests", type=int, default=16, help="burst mode: concurrent requests per burst")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="burst mode")
    ap.add_argument("--max-tokens", type=int, default=128, help="burst mode: tokens every request generates")
    ap.add_argument("--bursts", type=int, default=3, help="burst mode: bursts per system; medians are reported")
    ap.add_argument("--systems", help=f"comma-separated; default: {','.join(SYSTEMS)} (locust), "
                                      f"{','.join(BURST_SYSTEMS)} (burst)")
    ap.add_argument("--peers-venv", default=str(PEERS_VENV), help="where `make peers` put vLLM")
    ap.add_argument("--out", default=str(ROOT / "loadtests" / "out" / "compare"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    allowed = BURST_SYSTEMS if args.mode == "burst" else SYSTEMS
    systems = [s.strip() for s in (args.systems or ",".join(allowed)).split(",") if s.strip()]
    if set(systems) - set(allowed):
        ap.error(f"unknown systems for --mode {args.mode}: {sorted(set(systems) - set(allowed))}; "
                 f"choose from {', '.join(allowed)}")
    model_dir = resolve_model(args.model)
    args.dtype = serving_dtype(model_dir, args.dtype)  # NOTE: every server computes in the engine's dtype
    if args.mode == "burst":
        vocab = len(load_tokenizer(model_dir))
        warm = burst_prompts(vocab, 1, args.prompt_tokens, "warm-up")
        bursts = [burst_prompts(vocab, args.burst_requests, args.prompt_tokens, b) for b in range(args.bursts)]
    else:
        workload = ensure(Path(args.workload))
    results = {}
    for system in systems:
        out = Path(args.out) / system
        python = Path(args.peers_venv) / "bin" / "python"
        skipped = None
        if system == "vllm" and not python.exists():
            skipped = f"{python} not found: run `make peers` to install vLLM's CPU build"
        elif system == "llama_server" and not LLAMA_SERVER.exists():
            skipped = f"{LLAMA_SERVER} not found: run `make peers` to build llama.cpp"
        elif system == "llama_server" and gguf_of(model_dir) is None:
            skipped = f"{model_dir} is no GGUF file: llama-server reads only those"
        if skipped:
            results[system] = {"skipped": skipped}
            print(f"{system}: skipped: {skipped}", flush=True)
            continue
        if system == "attnserve_inprocess":
            walls = inprocess_bursts(model_dir, args.dtype, args.threads, warm, bursts, args.max_tokens,
                                     out / "engine.log")
            results[system] = burst_summary(walls, args.burst_requests, args.max_tokens)
        else:
            port = free_port()
            cmd, model, env = server(system, model_dir, port, args.dtype, args.threads, Path(args.peers_venv),
                                     args.burst_requests)
            url = f"http://127.0.0.1:{port}"
            with running(cmd, url, out / "server.log", env=env):
                if args.mode == "burst":
                    walls = http_bursts(url, model, warm, bursts, args.max_tokens)
                    results[system] = burst_summary(walls, args.burst_requests, args.max_tokens)
                else:
                    warm_up(url, model)
                    start = time.monotonic()
                    code = run_locust(url, out, args.users, args.spawn_rate, args.duration, ["ChatStreamUser"],
                                      [model], workload)
                    results[system] = {**summarize(out, time.monotonic() - start), "locust_exit_code": code}
        print(f"{system}: {json.dumps({k: results[system].get(k) for k in KEYS})}", flush=True)
    inprocess = results.get("attnserve_inprocess", {}).get("output_tokens_per_s")
    if inprocess and "output_tokens_per_s" in results.get("attnserve", {}):
        results["attnserve"]["serving_efficiency"] = results["attnserve"]["output_tokens_per_s"] / inprocess
    print_table(args, model_dir, results)
    if args.json:
        Path(args.json).write_text(json.dumps({name: {**{k: r.get(k) for k in KEYS}, **(
            {"skipped": r["skipped"]} if "skipped" in r else {})} for name, r in results.items()}, indent=2))
    return results


if __name__ == "__main__":
    main()
