"""Process-test fixtures: real ps processes on 127.0.0.1, stopped however a test ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxps_runtime import launch

JOB_ID = "test-job"  # the job id of the ps processes the fixtures start


@pytest.fixture(scope="module")
def two_ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.LocalPs]:
    """Two ps processes shared by a module's tests; each test Inits them afresh."""
    logs: Path = tmp_path_factory.mktemp("ps-logs")
    running = launch.LocalPs.start(2, job_id=JOB_ID, log_dir=logs)
    yield running
    running.stop()
