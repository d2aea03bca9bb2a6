"""The system packages the tests drive for real, as `make system-deps` installs them (Debian's
prometheus and chromium). Tests reach them through conftest's fixtures (`promtool`, `prometheus`,
`chromium`), which mark each such test `system`: `make test-fast` leaves those out, so it needs no
root on a fresh machine.

`promtool check metrics` as the tests run it: every problem it reports but the one lint that
vLLM's own metric names break (server/vllm_metrics.py: vLLM names its series `vllm:*`, and
promtool's linter keeps ':' for recording rules)."""
from __future__ import annotations

import re
import shutil
import subprocess

PACKAGES = {"promtool": "prometheus", "prometheus": "prometheus", "chromium": "chromium"}  # command -> Debian package


def require(command: str) -> str:
    """The command's path; fails, naming the package, where it is missing."""
    path = shutil.which(command) or (shutil.which("chromium-browser") if command == "chromium" else None)
    assert path, f"{command} missing: `make system-deps` (run by `make test`) installs Debian's {PACKAGES[command]} package"
    return path

VLLM_COLON = re.compile(r"vllm:\w+ metric names should not contain ':'")


class Promtool:
    """`promtool(text)`: metrics_problems; `.path`: the executable, for its other checks."""

    def __init__(self) -> None:
        self.path = require("promtool")

    def __call__(self, text: bytes) -> list[str]:
        return metrics_problems(text)


def metrics_problems(text: bytes) -> list[str]:
    """What promtool finds wrong with an exposition, less vLLM's names: [] when it passes."""
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    lines = (res.stdout + res.stderr).decode().splitlines()
    problems = [line for line in lines if line.strip() and not VLLM_COLON.fullmatch(line.strip())]
    if res.returncode not in (0, 3):  # 3: lint problems only, each listed above
        problems.append(f"promtool exited {res.returncode}")
    return problems


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=8000", "--window-size=1280,1400"]


def run_chromium(*args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on this machine's closed network (no background connections)."""
    return subprocess.run([require("chromium"), *CHROMIUM_FLAGS, *args], capture_output=True, text=True, timeout=120)
