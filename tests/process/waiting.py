"""Waiting on a local job with a deadline; a timeout fails with every task's log."""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.process import harness


def wait_for(
    condition: Callable[[], bool], job: harness.LocalJob, *, timeout: float = 120, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{job.logs()}"
        time.sleep(0.05)
