"""`make test`'s two xdist workers (tests/scheduling.py): the files a unit groups run on one worker,
each file whole on one worker, in a real inner `pytest -n 2` run."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFTEST = """
from tests import scheduling

SHARED = {"test_a.py", "test_b.py"}  # as the session's Ray files are in tests/conftest.py


def pytest_collection_modifyitems(items):
    files = {item.nodeid.split("::")[0] for item in items}
    scheduling.publish({f: "shared" if f in SHARED else f for f in files})


def pytest_configure(config):
    scheduling.configure(config)


def pytest_xdist_make_scheduler(config, log):
    return scheduling.make_scheduler(config, log)
"""
TESTS = """
import time

import pytest


@pytest.mark.parametrize("i", range(4))
def test_one(i):
    time.sleep(0.05)
"""


def test_a_unit_runs_on_one_worker_and_every_file_whole(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(**{f"test_{name}": TESTS for name in "abcde"})
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=20)
    out = result.stdout.str()
    workers: dict[str, set[str]] = {}
    for worker, module in re.findall(r"\[(gw\d)\] .*PASSED (test_\w)\.py::", out):
        workers.setdefault(module, set()).add(worker)
    assert set(workers) == {f"test_{name}" for name in "abcde"}
    assert all(len(w) == 1 for w in workers.values()), workers  # no file split over both workers
    assert workers["test_a"] == workers["test_b"]  # the shared unit: one worker
    assert len(set().union(*workers.values())) == 2  # and both workers took work
