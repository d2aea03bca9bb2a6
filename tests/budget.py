"""CI's time budget and the two guards that hold it (docs/testing.md).

CI has 90 minutes on 2 cores; our guard is 40 and our target 30, so that a few more issues' tests still land.
- Per test: a test that runs past PER_TEST_LIMIT_S without `@pytest.mark.slow` fails, naming
  itself (the conftest hook below): a slow case must say so, and one that grew is caught the day
  it grows, not when the whole run passes 90 minutes.
- Per run: `.ci/run` times its steps, and each pytest run it makes writes its tests' seconds to
  the directory TIMES_ENV names. `python -m tests.budget --times DIR install=S test=S ...` prints
  the steps and fails when the whole run passes BUDGET_S, naming the step furthest past its
  target (TARGETS_S) and the 10 slowest tests of the run. A step past its target alone is named
  without failing the run: the same suite takes minutes longer on some of CI's CPU kinds.
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PER_TEST_LIMIT_S = 120.0
BUDGET_S = 40 * 60
# NOTE: each step's share of the 30-minute target, from a fresh clone on a 2-core Zen 4 (docs/testing.md)
TARGETS_S = {"install": 4 * 60, "make lint": 60, "system-deps": 60, "make test": 17 * 60, "make test-isa": 7 * 60}
STEP_NAMES = {"install": "install", "lint": "make lint", "test": "make test", "test-isa": "make test-isa"}
TIMES_ENV = "ATTNSERVE_TEST_TIMES"  # a directory: each pytest run writes {pass, tests: {node id: s}} there
NUM_SLOWEST = 10


def per_test_limit() -> float:
    """ATTNSERVE_TEST_LIMIT_S overrides the limit (the guard's own test runs it at a fraction of a second)."""
    return float(os.environ.get("ATTNSERVE_TEST_LIMIT_S", PER_TEST_LIMIT_S))


def over_limit(nodeid: str, seconds: float, marked_slow: bool, limit: float) -> str | None:
    """The failure message for a test that took `seconds` (set-up and call), or None."""
    if marked_slow or seconds <= limit:
        return None
    return (f"{nodeid} took {seconds:.1f} s, over the {limit:g} s a test may take without "
            "@pytest.mark.slow (tests/budget.py): make it cheaper, or mark it slow and say why")


def step_seconds(argv: list[str]) -> dict[str, float]:
    """`install=152 test=1186` -> {"install": 152.0, "make test": 1186.0}."""
    steps = {}
    for arg in argv:
        step, _, seconds = arg.partition("=")
        steps[STEP_NAMES.get(step, step)] = float(seconds)
    return steps


def missed_targets(steps: dict[str, float]) -> list[str]:
    """One line per step over its target (TARGETS_S)."""
    return [f"ci time target missed: {name} took {seconds / 60:.1f} min, over its {TARGETS_S[name] / 60:g} min target"
            for name, seconds in steps.items() if seconds > TARGETS_S.get(name, float("inf"))]


def grown_step(steps: dict[str, float]) -> str | None:
    """The step furthest past its target, or None when every step is on target."""
    over = {name: s - TARGETS_S[name] for name, s in steps.items() if name in TARGETS_S and s > TARGETS_S[name]}
    if not over:
        return None
    name = max(over, key=over.get)
    return (f"the step that grew: {name} took {steps[name] / 60:.1f} min, {over[name] / 60:.1f} min over its "
            f"{TARGETS_S[name] / 60:g} min target")


def read_times(directory: Path) -> list[tuple[float, str, str]]:
    """(seconds, pass, node id) of every test the run's pytest processes reported, the slowest first."""
    rows = []
    for path in sorted(directory.glob("*.json")):
        report = json.loads(path.read_text())
        rows += [(seconds, report["pass"], nodeid) for nodeid, seconds in report["tests"].items()]
    return sorted(rows, reverse=True)


def budget_failures(steps: dict[str, float], times: list[tuple[float, str, str]] = ()) -> list[str]:
    """The run's failure, if the total is over BUDGET_S: what grew and the slowest tests, to start from."""
    total = sum(steps.values())
    if total <= BUDGET_S:
        return []
    lines = [f"CI time budget exceeded: total took {total / 60:.1f} min, over its {BUDGET_S / 60:.0f} min "
             "(tests/budget.py; CI's hard limit is 90 min; the target is 30)"]
    lines += [grown] if (grown := grown_step(steps)) else []
    if times:
        lines.append(f"the {min(NUM_SLOWEST, len(times))} slowest tests (set-up, call and teardown; the pass in brackets):")
        lines += [f"  {seconds:7.1f} s  [{name}] {nodeid}" for seconds, name, nodeid in times[:NUM_SLOWEST]]
    return lines


def report(steps: dict[str, float]) -> str:
    lines = [f"ci time: {name:<14} {s:7.0f} s  ({s / 60:.1f} min)" for name, s in steps.items()]
    total = sum(steps.values())
    return "\n".join([*lines, f"ci time: {'total':<14} {total:7.0f} s  ({total / 60:.1f} min, target 30, budget "
                                f"{BUDGET_S / 60:.0f})"])


def main(argv: list[str]) -> int:
    """`python -m tests.budget [--times DIR] install=152 test=1186 test-isa=471`: the table; 1 if over budget."""
    times: list[tuple[float, str, str]] = []
    if argv[:1] == ["--times"]:
        times, argv = read_times(Path(argv[1])), argv[2:]
    steps = step_seconds(argv)
    print(report(steps))
    failures = budget_failures(steps, times)
    for message in [*missed_targets(steps), *failures]:
        print(message, file=sys.stderr)
    return 1 if failures else 0


# --- the pytest side: imported into tests/conftest.py -------------------------------------------

_SETUP_S = pytest.StashKey[float]()
_FILE_S: dict[str, float] = defaultdict(float)
_TEST_S: dict[str, float] = defaultdict(float)
_MARKER_S: dict[str, float] = defaultdict(float)
_MARKERS: set[str] = set()  # the registered marks (pyproject.toml), read at configure time


def pass_name() -> str:
    """The CI pass a pytest run is, from what sets it apart: the ISA cap and the emulated tiles."""
    isa = os.environ.get("ATTNSERVE_CPU_ISA", "") or "native"
    return f"{isa} amx-emulated" if os.environ.get("ATTNSERVE_AMX_EMULATION") == "1" else isa


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
    _TEST_S[report.nodeid] += report.duration
    for name in _MARKERS.intersection(report.keywords) or {"(none)"}:
        _MARKER_S[name] += report.duration


def configure(config) -> None:
    """From conftest's pytest_configure: the marks the per-marker table sums."""
    _MARKERS.update(line.split(":")[0].strip() for line in config.getini("markers"))


def pytest_terminal_summary(terminalreporter):
    """Seconds per test file and per marker (set-up, call and teardown), the slowest first."""
    if not _FILE_S:
        return
    terminalreporter.section("seconds per file")
    for path, seconds in sorted(_FILE_S.items(), key=lambda kv: -kv[1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_FILE_S.values()):8.1f} s  in all")
    terminalreporter.section("seconds per marker (a test counts under each of its marks)")
    for name, seconds in sorted(_MARKER_S.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {name}")


def pytest_sessionfinish(session):
    """On the controller (or a run without xdist), with TIMES_ENV set: this run's seconds per test."""
    directory = os.environ.get(TIMES_ENV)
    if not directory or hasattr(session.config, "workerinput") or not _TEST_S:
        return
    path = Path(directory) / f"{os.getpid()}-{len(list(Path(directory).glob('*.json')))}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pass": pass_name(), "tests": _TEST_S}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
