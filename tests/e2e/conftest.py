"""Fixtures of the e2e tier; they live in harness.py, with the helpers the tests use."""

import pytest

from tests.cluster.harness import pytest_runtest_makereport
from tests.e2e.harness import PHASES, installed, jobs, node

__all__ = ["installed", "jobs", "node", "pytest_runtest_makereport"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The tier's phases (builds, node up, installs, each job, node down) with their times."""
    if PHASES:
        terminalreporter.section("e2e phases")
        for line in PHASES:
            terminalreporter.write_line(line)
