"""`promtool check metrics` as the tests run it: every problem it reports but the one lint that
vLLM's own metric names break (server/vllm_metrics.py: vLLM names its series `vllm:*`, and
promtool's linter keeps ':' for recording rules)."""
from __future__ import annotations

import re
import subprocess

VLLM_COLON = re.compile(r"vllm:\w+ metric names should not contain ':'")


def metrics_problems(text: bytes) -> list[str]:
    """What promtool finds wrong with an exposition, less vLLM's names: [] when it passes."""
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    lines = (res.stdout + res.stderr).decode().splitlines()
    problems = [line for line in lines if line.strip() and not VLLM_COLON.fullmatch(line.strip())]
    if res.returncode not in (0, 3):  # 3: lint problems only, each listed above
        problems.append(f"promtool exited {res.returncode}")
    return problems
