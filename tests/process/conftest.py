"""Process-test fixtures: real processes on 127.0.0.1, stopped however a test ends."""

from __future__ import annotations

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
