"""Process-test fixtures: real processes on 127.0.0.1, stopped however a test ends."""

from __future__ import annotations

import json
import math
import os
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jaxps_runtime.config import cluster
from tests.process import harness

JOB_ID = "test-job"  # the job id of the ps processes the fixtures start


def pytest_configure(config: pytest.Config) -> None:
    """What every process a test starts inherits (`processes.node_env` passes this process's
    environment on):

    - one JAX compilation cache for the tier, kept between runs outside the repository (its
      keys hold the program, JAX's version and flags and the CPU, so a stale entry is never
      read): a worker's model, a ps's optimizer update are compiled once, not once per test;
    - with pytest-xdist, each worker's own slice of the ports `free_ports` picks from
      (JAXPS_PORTS), so two jobs started side by side never pick the same port."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache / "jaxps" / "jax-tests"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "JAXPS_PORTS" not in os.environ:
        first, end = cluster.port_range()
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        width = (end - first) // max(count, 1)
        start = first + int(worker[2:]) * width
        os.environ["JAXPS_PORTS"] = f"{start}-{start + width - 1}"


@pytest.fixture(scope="module")
def two_ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.LocalPs]:
    """Two ps processes shared by a module's tests; each test Inits them afresh."""
    logs: Path = tmp_path_factory.mktemp("ps-logs")
    running = harness.LocalPs.start(2, job_id=JOB_ID, log_dir=logs)
    yield running
    running.stop()


@pytest.fixture
def jobs() -> Iterator[list[harness.LocalJob]]:
    """Jobs a test starts; whatever happens, none of their processes outlives the test."""
    started: list[harness.LocalJob] = []
    yield started
    for job in started:
        job.stop()


def _read_metric(port: int, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def metric() -> Callable[[int, str], float | None]:
    """Reads one jaxps metric from a task's /metrics (None while it does not answer)."""
    return _read_metric


# --- the longest first: pytest-xdist's workers end together -----------------------------------

DURATIONS = Path(__file__).resolve().parents[2] / ".work" / "durations" / "process.json"


def _scope(item: pytest.Item) -> str:
    """What one worker runs as a whole: the test's xdist_group (a module whose processes are
    module-scoped), else the test itself."""
    group = item.get_closest_marker("xdist_group")
    return str(group.args[0]) if group is not None and group.args else item.nodeid


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each scope's tests together, the scopes in the order of their last run's time, longest
    first (unknown ones, new tests, before all): longest-processing-time-first, so no worker is
    left with one long test while the others are done. Every worker reads the same file, so
    all collect the same order, as xdist requires; without the file, the order is as written."""
    try:
        seconds: dict[str, float] = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    per_scope: dict[str, float] = {}
    for item in items:
        known = seconds.get(item.nodeid)
        scope = _scope(item)
        per_scope[scope] = per_scope.get(scope, 0.0) + (math.inf if known is None else known)
    first = {scope: i for i, scope in reversed(list(enumerate(map(_scope, items))))}
    items.sort(key=lambda item: (-per_scope[_scope(item)], first[_scope(item)]))


_SEEN: dict[str, float] = {}  # each test's time in this run (setup, call and teardown)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A test's time, as the process that reports it (xdist's controller, or a lone one)
    hears of it."""
    _SEEN[report.nodeid] = _SEEN.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The times of a run that passed are kept for the next (merged into those of the tests
    it did not run)."""
    if hasattr(session.config, "workerinput") or not _SEEN or exitstatus != 0:
        return
    try:
        kept: dict[str, float] = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        kept = {}
    DURATIONS.parent.mkdir(parents=True, exist_ok=True)
    DURATIONS.write_text(json.dumps(kept | _SEEN, indent=0, sort_keys=True))
