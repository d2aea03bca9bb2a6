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
    """Run `cmd` until the block ends (`stop_signal`, then SIGKILL); yields `url` once it answers."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", **(env or {})})
        try:
            wait_ready(url, proc, path, timeout)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, stop_signal)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def attnserve_cmd(models: dict[str, str], port: int, extra: list[str] | None = None) -> list[str]:
    cmd = [str(BIN / "attnserve"), "serve", "--port", str(port)]
    for name, source in models.items():
        cmd += ["--model", f"{name}={source}"]
    return cmd + list(extra or [])
