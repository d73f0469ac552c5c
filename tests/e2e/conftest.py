"""Fixtures of the e2e tier; they live in harness.py, with the helpers the tests use.

With pytest-xdist (`make test` runs the tier with `-n`), the session's controller brings the
one node up and installs the operator before its workers start, and takes it down after they
end: every worker's tests run on that node, each in its own namespace. A test marked
`exclusive` (it kills or replaces what every job shares: the operator, Kueue) runs with no
other test at once; the others run side by side.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from tests.cluster.harness import ROOT, pytest_runtest_makereport
from tests.e2e import harness
from tests.e2e.harness import installed, jobs, node

__all__ = ["installed", "jobs", "node", "pytest_runtest_makereport"]

_NODE = pytest.StashKey[contextlib.ExitStack]()
_PHASES = pytest.StashKey[int]()
PHASES_LOG = ROOT / ".work" / "e2e" / "phases.log"


def _controller(config: pytest.Config) -> bool:
    """Whether this process is the controller of xdist workers (not a worker, not alone)."""
    return not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", None))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "exclusive: kills or replaces what every job shares; runs with no other test"
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    """As the controller of xdist workers: the node up and the operator installed, once."""
    config = session.config
    if hasattr(config, "workerinput"):
        return
    config.stash[_PHASES] = PHASES_LOG.stat().st_size if PHASES_LOG.exists() else 0
    if not _controller(config):
        return  # alone: the `node` fixture brings it up when a test needs it
    stack = contextlib.ExitStack()
    config.stash[_NODE] = stack
    try:
        up = stack.enter_context(harness.node_up())
        harness.install(up)
    except BaseException:
        stack.close()
        raise
    os.environ[harness.SHARED] = str(up.state)  # the workers, started after this, inherit it


def pytest_sessionfinish(session: pytest.Session) -> None:
    stack = session.config.stash.get(_NODE, None)
    if stack is not None:
        stack.close()
        os.environ.pop(harness.SHARED, None)


@pytest.fixture(autouse=True)
def _turn(request: pytest.FixtureRequest) -> Iterator[None]:
    """Side by side, or alone for an `exclusive` test (`harness.turn`)."""
    with harness.turn(exclusive=request.node.get_closest_marker("exclusive") is not None):
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The exclusive tests first: each holds the node alone, so every other worker waits;
    first, they wait while the cluster tier, which runs beside this one from its start, uses
    the CPU they leave, not in the middle of the tier (xdist hands tests out in this order)."""
    items.sort(key=lambda item: item.get_closest_marker("exclusive") is None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The tier's phases (builds, node up, installs, each job, node down) with their times,
    every worker's: from .work/e2e/phases.log, where each writes them as they happen."""
    start = terminalreporter.config.stash.get(_PHASES, None)
    if start is None or not PHASES_LOG.exists():
        return
    with open(PHASES_LOG) as log:
        log.seek(start)
        lines = log.read().splitlines()
    if lines:
        terminalreporter.section("e2e phases")
        for line in lines:
            terminalreporter.write_line(line)
