"""The assignment a ps standby takes, checked before it becomes anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jaxps_runtime.process import standby


def _line(**changes: object) -> str:
    raw: dict[str, object] = {
        "env": {"TF_CONFIG": "{}", "JAXPS_METRICS_PORT": "0"},
        "stdout": "/tmp/ps-0.out",
        "stderr": "/tmp/ps-0.log",
    }
    raw.update(changes)
    return json.dumps(raw)


def test_an_assignment_with_only_what_differs_between_two_ps_is_taken() -> None:
    taken = standby.assignment(_line())
    assert taken["env"]["TF_CONFIG"] == "{}"
    assert taken["stderr"] == "/tmp/ps-0.log"


@pytest.mark.parametrize(
    ("line", "names"),
    [
        ("not json", "not JSON"),
        ("[]", "env, stdout and stderr"),
        (_line(extra=1), "env, stdout and stderr"),
        (_line(env={"TF_CONFIG": 3}), "env: expected an object of strings"),
        # what JAX read as the standby loaded cannot be changed afterwards
        (_line(env={"XLA_FLAGS": "--x"}), "env: got XLA_FLAGS; a standby takes only"),
        (_line(env={"JAXPS_TRAINING": "{}"}), "env: got JAXPS_TRAINING"),
        (_line(stdout=""), "stdout: expected a file path"),
        (_line(stderr=None), "stderr: expected a file path"),
    ],
)
def test_any_other_assignment_is_refused_with_what_is_wrong(line: str, names: str) -> None:
    with pytest.raises(standby.StandbyError, match=names):
        standby.assignment(line)


def test_a_standby_runs_only_the_jaxps_runtime_never_a_command_of_the_users(
    tmp_path: Path,
) -> None:
    assert standby.runs_the_runtime([sys.executable, "-m", "jaxps_runtime", "--log-level=DEBUG"])
    assert not standby.runs_the_runtime(["python", "-c", "import time"])
    with pytest.raises(ValueError, match="a standby runs"):
        standby.Standby({}, log=tmp_path / "standby.log", argv=["sleep", "100"])
    assert not (tmp_path / "standby.log").exists()  # nothing was started
