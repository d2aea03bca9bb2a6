"""The guards that hold CI to its time budget (tests/budget.py), fed fake durations: a test past its
limit without @pytest.mark.slow fails and names itself; a run past its budget fails, naming the step that
grew and the run's 10 slowest tests from the seconds its pytest runs wrote."""
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.budget import BUDGET_S, TARGETS_S, TIMES_ENV, budget_failures, main, missed_targets, over_limit, step_seconds

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


def test_a_test_past_the_limit_without_the_slow_mark_fails_naming_itself(pytester, monkeypatch, tmp_path):
    """A real pytest run with the conftest hooks and a limit of 0.5 s: set-up counts, the slow mark
    exempts, a test that failed already keeps its own failure; the run prints its seconds per marker
    and writes its seconds per test where TIMES_ENV says."""
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n")
    pytester.makeconftest("from tests import budget\n"
                          "from tests.budget import (pytest_runtest_logreport, pytest_runtest_makereport,  # noqa: F401\n"
                          "    pytest_sessionfinish, pytest_terminal_summary)\n"
                          "def pytest_configure(config):\n    budget.configure(config)\n")
    pytester.makepyfile(test_inner=INNER)
    with monkeypatch.context() as env:  # NOTE: the inner run's limit only, not this test's own
        env.setenv("ATTNSERVE_TEST_LIMIT_S", "0.5")
        env.setenv("PYTHONPATH", str(ROOT))
        env.setenv(TIMES_ENV, str(tmp_path / "times"))
        env.setenv("ATTNSERVE_CPU_ISA", "avx2")
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=3)
    out = result.stdout.str()
    assert re.search(r"test_inner.py::test_long took 0\.\d s, over the 0.5 s a test may take without "
                     r"@pytest.mark.slow", out)
    assert re.search(r"test_inner.py::test_long_set_up took 0\.\d s, over the 0.5 s", out)  # 0.3 s set-up + 0.3 s call
    assert "test_long_and_says_so took" not in out and "test_quick took" not in out
    assert "its own failure" in out and "test_long_and_failing took" not in out
    per_marker = out[out.index("seconds per marker"):]
    assert re.search(r"\n +0\.[67] s  slow\n", per_marker) and re.search(r"\n +[12]\.\d s  \(none\)\n", per_marker)
    (written,) = (tmp_path / "times").glob("*.json")
    report = json.loads(written.read_text())
    assert report["pass"] == "avx2" and len(report["tests"]) == 5
    assert 0.6 <= report["tests"]["test_inner.py::test_long_set_up"] < 2  # set-up, call and teardown


def test_over_limit_messages():
    assert over_limit("tests/t.py::a", 119.9, False, 120) is None
    assert over_limit("tests/t.py::a", 500, True, 120) is None
    assert "tests/t.py::a took 121.0 s, over the 120 s" in over_limit("tests/t.py::a", 121, False, 120)


def fake_times(directory: Path) -> None:
    """Two pytest runs' reports, as make test and make test-isa's AVX2 pass write them: 12 tests."""
    directory.mkdir()
    native = {f"tests/test_a.py::test_{i}": 10.0 * i for i in range(1, 9)}
    (directory / "1-0.json").write_text(json.dumps({"pass": "native", "tests": native}))
    avx2 = {"tests/test_b.py::test_x": 45.0, "tests/test_b.py::test_y": 5.0, "tests/test_b.py::test_z": 1.0,
            "tests/test_a.py::test_8": 75.0}
    (directory / "2-0.json").write_text(json.dumps({"pass": "avx2", "tests": avx2}))


def test_a_run_past_its_budget_fails_naming_the_step_that_grew_and_the_slowest_tests(capsys, tmp_path):
    ok = {"install": 150, "test": 16 * 60, "test-isa": 7 * 60}
    assert budget_failures(step_seconds([f"{k}={v}" for k, v in ok.items()])) == []
    assert main([f"{k}={v}" for k, v in ok.items()]) == 0
    assert "ci time: total" in capsys.readouterr().out
    slow_suite = {**ok, "test": 26 * 60}  # past its 17 min target; the total (36.5 min) is not past 40
    steps = step_seconds([f"{k}={v}" for k, v in slow_suite.items()])
    assert budget_failures(steps) == [] and main([f"{k}={v}" for k, v in slow_suite.items()]) == 0
    assert "make test took 26.0 min, over its 17 min target" in capsys.readouterr().err
    assert missed_targets(steps) == ["ci time target missed: make test took 26.0 min, over its 17 min target"]
    fake_times(tmp_path / "times")
    over = {**ok, "test": 25 * 60, "test-isa": 13 * 60}  # 40.5 min: make test 8 min over, test-isa 6
    assert main(["--times", str(tmp_path / "times"), *(f"{k}={v}" for k, v in over.items())]) == 1
    err = capsys.readouterr().err
    assert "CI time budget exceeded: total took 40.5 min, over its 40 min" in err
    assert "the step that grew: make test took 25.0 min, 8.0 min over its 17 min target" in err
    slowest = err[err.index("the 10 slowest tests"):].splitlines()[1:]
    assert slowest[:3] == ["     80.0 s  [native] tests/test_a.py::test_8", "     75.0 s  [avx2] tests/test_a.py::test_8",
                           "     70.0 s  [native] tests/test_a.py::test_7"]
    assert len(slowest) == 10 and "[avx2] tests/test_b.py::test_x" in slowest[5]
    assert not any("test_z" in line or "test_b.py::test_y" in line for line in slowest)  # the two fastest of 12
    assert BUDGET_S == 40 * 60 and sum(TARGETS_S.values()) == 30 * 60


def test_the_ci_script_calls_the_guard_and_it_exits_1(tmp_path):
    """`python -m tests.budget`, as .ci/run calls it, on a fake report of a run that took too long."""
    fake_times(tmp_path / "times")
    proc = subprocess.run([sys.executable, "-m", "tests.budget", "--times", str(tmp_path / "times"), "install=300",
                           "lint=5", "system-deps=20", "test=1300", "test-isa=1000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "total took 43.8 min, over its 40 min" in proc.stderr
    assert "the step that grew: make test-isa took 16.7 min, 9.7 min over its 7 min target" in proc.stderr
    assert "[native] tests/test_a.py::test_8" in proc.stderr
    assert "ci time: make test-isa" in proc.stdout and "ci time: total" in proc.stdout
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'python -m tests.budget --times "$ATTNSERVE_TEST_TIMES"' in ci and "export ATTNSERVE_TEST_TIMES=" in ci


def test_make_test_fast_needs_no_system_package():
    """`make test-fast` runs on a fresh machine where only `make install` ran: it leaves out the tests
    marked `system`, and a test reaches promtool, Prometheus or Chromium only through the fixtures that
    mark it (conftest SYSTEM_FIXTURES): no other test module imports tests/system_tools.py."""
    from tests.conftest import SYSTEM_FIXTURES

    makefile = (ROOT / "Makefile").read_text()
    (rule,) = [line for line in makefile.splitlines() if line.startswith("test-fast:")]
    assert "system-deps" not in rule
    recipe = makefile[makefile.index(rule):].splitlines()[1]
    assert "and not system" in recipe and "pytest" in recipe
    assert SYSTEM_FIXTURES == {"promtool", "prometheus", "chromium"}
    users = [p.name for p in (ROOT / "tests").glob("*.py") if "system_tools" in p.read_text()]
    assert sorted(users) == ["conftest.py", "test_budget.py"]
