"""The guards that hold CI to its time budget (tests/budget.py), fed fake durations: a test past its
limit without @pytest.mark.slow fails and names itself; a run past its budget fails and names the step."""
import re
import subprocess
import sys
from pathlib import Path

from tests.budget import BUDGET_S, budget_failures, main, missed_targets, over_limit

ROOT = Path(__file__).resolve().parents[1]
INNER = """
import time

import pytest


@pytest.fixture
def slow_setup():
    time.sleep(0.3)


def test_quick():
    pass


def test_long():
    time.sleep(0.6)


def test_long_set_up(slow_setup):
    time.sleep(0.3)


@pytest.mark.slow
def test_long_and_says_so():
    time.sleep(0.6)


def test_long_and_failing():
    time.sleep(0.6)
    assert False, "its own failure"
"""


def test_a_test_past_the_limit_without_the_slow_mark_fails_naming_itself(pytester, monkeypatch):
    """A real pytest run with the conftest hook and a limit of 0.5 s: set-up counts, the slow mark
    exempts, a test that failed already keeps its own failure."""
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n")
    pytester.makeconftest("from tests.budget import pytest_runtest_makereport  # noqa: F401\n")
    pytester.makepyfile(test_inner=INNER)
    with monkeypatch.context() as env:  # NOTE: the inner run's limit only, not this test's own
        env.setenv("ATTNSERVE_TEST_LIMIT_S", "0.5")
        env.setenv("PYTHONPATH", str(ROOT))
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=3)
    out = result.stdout.str()
    assert re.search(r"test_inner.py::test_long took 0\.\d s, over the 0.5 s a test may take without "
                     r"@pytest.mark.slow", out)
    assert re.search(r"test_inner.py::test_long_set_up took 0\.\d s, over the 0.5 s", out)  # 0.3 s set-up + 0.3 s call
    assert "test_long_and_says_so took" not in out and "test_quick took" not in out
    assert "its own failure" in out and "test_long_and_failing took" not in out


def test_over_limit_messages():
    assert over_limit("tests/t.py::a", 119.9, False, 120) is None
    assert over_limit("tests/t.py::a", 500, True, 120) is None
    assert "tests/t.py::a took 121.0 s, over the 120 s" in over_limit("tests/t.py::a", 121, False, 120)


def test_a_run_past_its_budget_fails_and_a_step_past_its_target_is_named(capsys):
    ok = {"install": 300, "test": 20 * 60, "test-isa": 8 * 60}
    assert budget_failures(ok) == missed_targets(ok) == [] and main([f"{k}={v}" for k, v in ok.items()]) == 0
    assert "ci time: total" in capsys.readouterr().out
    slow_suite = {**ok, "test": 26 * 60}  # past 25 min: the total (39 min) is not
    assert budget_failures(slow_suite) == [] and main([f"{k}={v}" for k, v in slow_suite.items()]) == 0
    assert "make test took 26.0 min, over its 25 min target" in capsys.readouterr().err
    everything = {"install": 600, "test": 24 * 60, "test-isa": 9 * 60}  # each on target, 43 min in all
    (message,) = budget_failures(everything)
    assert message.startswith("CI time budget exceeded: total took 43.0 min, over its 40 min")
    assert missed_targets(everything) == [] and BUDGET_S == 40 * 60


def test_the_ci_script_calls_the_guard_and_it_exits_1():
    """`python -m tests.budget`, as .ci/run calls it, on a fake report of a run that took too long."""
    proc = subprocess.run([sys.executable, "-m", "tests.budget", "install=300", "test=1400", "test-isa=900"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "total took 43.3 min, over its 40 min" in proc.stderr
    assert "make test-isa took 15.0 min, over its 10 min target" in proc.stderr
    assert "ci time: make test-isa" in proc.stdout and "ci time: total" in proc.stdout
    assert "python -m tests.budget" in (ROOT / ".ci" / "run").read_text()
