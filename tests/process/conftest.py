"""Process-test fixtures: real processes on 127.0.0.1, stopped however a test ends."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.process import harness

JOB_ID = "test-job"  # the job id of the ps processes the fixtures start


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
