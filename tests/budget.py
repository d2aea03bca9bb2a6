"""CI's time budget and the two guards that hold it.

CI has 90 minutes on 2 cores; our budget is 40, so that a few more issues' tests still land.
- Per test: a test that runs past PER_TEST_LIMIT_S without `@pytest.mark.slow` fails, naming
  itself (the conftest hook below): a slow case must say so, and one that grew is caught the day
  it grows, not when the whole run passes 90 minutes.
- Per run: `.ci/run` times its steps and `python -m tests.budget install=S test=S test-isa=S`
  prints them and fails when the whole run passes BUDGET_S. Each step's own target (TARGETS_S)
  is printed and, when missed, named, without failing the run: the same suite takes 23 min on one
  of CI's CPU kinds and 29 on another (AMD Zen 4), so only the total holds on every machine.
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict

import pytest

PER_TEST_LIMIT_S = 120.0
# NOTE: the targets, from a fresh clone on a 2-core machine, install included
BUDGET_S = 40 * 60
TARGETS_S = {"make test": 25 * 60, "make test-isa": 10 * 60}
STEP_NAMES = {"install": "install", "lint": "make lint", "test": "make test", "test-isa": "make test-isa"}


def per_test_limit() -> float:
    """ATTNSERVE_TEST_LIMIT_S overrides the limit (the guard's own test runs it at a fraction of a second)."""
    return float(os.environ.get("ATTNSERVE_TEST_LIMIT_S", PER_TEST_LIMIT_S))


def over_limit(nodeid: str, seconds: float, marked_slow: bool, limit: float) -> str | None:
    """The failure message for a test that took `seconds` (set-up and call), or None."""
    if marked_slow or seconds <= limit:
        return None
    return (f"{nodeid} took {seconds:.1f} s, over the {limit:g} s a test may take without "
            "@pytest.mark.slow (tests/budget.py): make it cheaper, or mark it slow and say why")


def budget_failures(step_seconds: dict[str, float]) -> list[str]:
    """The run's failure, if the total is over BUDGET_S."""
    total = sum(step_seconds.values())
    if total <= BUDGET_S:
        return []
    return [f"CI time budget exceeded: total took {total / 60:.1f} min, over its {BUDGET_S / 60:.0f} min "
            "(tests/budget.py; CI's hard limit is 90 min): find the new cost in the --durations tables above"]


def missed_targets(step_seconds: dict[str, float]) -> list[str]:
    """One line per step over its target (TARGETS_S)."""
    named = {STEP_NAMES.get(step, step): s for step, s in step_seconds.items()}
    return [f"ci time target missed: {name} took {named[name] / 60:.1f} min, over its {limit / 60:.0f} min target"
            for name, limit in TARGETS_S.items() if named.get(name, 0) > limit]


def report(step_seconds: dict[str, float]) -> str:
    lines = [f"ci time: {STEP_NAMES.get(step, step):<14} {s:7.0f} s  ({s / 60:.1f} min)" for step, s in step_seconds.items()]
    total = sum(step_seconds.values())
    return "\n".join([*lines, f"ci time: {'total':<14} {total:7.0f} s  ({total / 60:.1f} min, budget "
                                f"{BUDGET_S / 60:.0f})"])


def main(argv: list[str]) -> int:
    """`python -m tests.budget install=312 test=1190 test-isa=402`: the table; 1 if over budget."""
    steps = {}
    for arg in argv:
        step, _, seconds = arg.partition("=")
        steps[step] = float(seconds)
    print(report(steps))
    failures = budget_failures(steps)
    for message in [*missed_targets(steps), *failures]:
        print(message, file=sys.stderr)
    return 1 if failures else 0


# --- the pytest side: imported into tests/conftest.py -------------------------------------------

_SETUP_S = pytest.StashKey[float]()
_FILE_S: dict[str, float] = defaultdict(float)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "setup":
        item.stash[_SETUP_S] = rep.duration
    elif rep.when == "call" and rep.passed:
        seconds = item.stash.get(_SETUP_S, 0.0) + rep.duration
        message = over_limit(item.nodeid, seconds, item.get_closest_marker("slow") is not None, per_test_limit())
        if message:  # NOTE: the test itself fails, so the run fails and the summary names it
            rep.outcome, rep.longrepr = "failed", message


def pytest_runtest_logreport(report):
    """NOTE: here, not in makereport: under xdist only the controller's reports reach the summary."""
    _FILE_S[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    """Seconds per test file (set-up, call and teardown), the slowest first."""
    if not _FILE_S:
        return
    terminalreporter.section("seconds per file")
    for path, seconds in sorted(_FILE_S.items(), key=lambda kv: -kv[1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_FILE_S.values()):8.1f} s  in all")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
