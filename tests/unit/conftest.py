"""Fixtures of the unit tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxps_runtime.process import termination


@pytest.fixture
def termination_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The termination-message file a task writes (`JAXPS_TERMINATION_LOG`), empty."""
    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setenv(termination.ENV, str(log))
    return log
