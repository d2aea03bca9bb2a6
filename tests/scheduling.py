"""`make test` on two xdist workers: one work unit per test file, except that every file on the
session's Ray is one unit, so that one Ray cluster and its Serve applications serve them all.

xdist's own `--dist loadgroup` cannot be used: it renames each item's node id, which pytest 9.2 no
longer lets a plugin do, and it then silently spreads a file's tests over both workers (each worker
started its own Ray and set each module's Serve app up again). Here the workers say which unit each
file belongs to in a file the controller names, and the controller's scheduler reads it once every
worker has collected.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

UNITS_ENV = "ATTNSERVE_TEST_UNITS"  # the controller's file of {test file: unit}, inherited by its workers


def configure(config) -> None:
    """On the controller of an xdist run: name the file before the workers start."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        fd, path = tempfile.mkstemp(prefix="attnserve-test-units-", suffix=".json")
        os.close(fd)
        os.environ[UNITS_ENV] = path
        config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))


def publish(units: dict[str, str]) -> None:
    """On a worker, after collection: every worker writes the same map; the last rename wins."""
    path, worker = os.environ.get(UNITS_ENV), os.environ.get("PYTEST_XDIST_WORKER")
    if path and worker:
        tmp = Path(f"{path}.{worker}")
        tmp.write_text(json.dumps(units))
        os.replace(tmp, path)


def make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileUnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (units in collection order, the next one to whichever worker is
        nearly done), with a scope per unit instead of per module."""

        units: dict[str, str] = {}

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed:
                # NOTE: each worker published before it reported its collection, which completed it
                self.units = json.loads(Path(os.environ[UNITS_ENV]).read_text())
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::")[0]
            return self.units.get(file, file)

    return FileUnitScheduling(config, log)
