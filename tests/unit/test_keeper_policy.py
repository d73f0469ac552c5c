"""The ps pod's keeper (`jaxps_runtime.process.keeper`): when a ps's end is a loss a standby may
make good, the exit code it passes on, the setting that turns it on, and the operator setting it
on a ps pod only, unless the template says otherwise."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from jaxps_operator import builders
from jaxps_runtime.config import cluster
from jaxps_runtime.process import keeper
from tests.unit.test_planner import job, step, with_env


@pytest.mark.parametrize(
    ("returncode", "lost"),
    [
        (-signal.SIGKILL, True),
        (-signal.SIGSEGV, True),
        (-signal.SIGABRT, True),
        (-signal.SIGTERM, False),  # stopped: the pod stops too
        (-signal.SIGINT, False),
        (0, False),  # done
        (1, False),  # failed: its own error, the operator's to see
        (2, False),
        (78, False),
        (137, False),  # an exit code of its own, not a death by signal
    ],
)
def test_only_a_death_by_a_signal_not_asked_for_is_taken_over(returncode: int, lost: bool) -> None:
    assert keeper.taken_over(returncode) is lost


@pytest.mark.parametrize(("returncode", "code"), [(0, 0), (1, 1), (78, 78), (-9, 137), (-15, 143)])
def test_the_exit_code_passed_on_is_the_shells(returncode: int, code: int) -> None:
    assert keeper.exit_code(returncode) == code


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"JAXPS_PS_STANDBY": "on"}, True),
        ({"JAXPS_PS_STANDBY": "ON"}, True),
        ({"JAXPS_PS_STANDBY": "off"}, False),
    ],
)
def test_the_keeper_runs_only_when_asked(environ: dict[str, str], on: bool) -> None:
    assert keeper.wanted(environ) is on


def test_a_wrong_standby_setting_is_refused_on_a_ps_naming_what_is_allowed() -> None:
    problem = cluster.setting_problem("JAXPS_PS_STANDBY", "yes", task_type=cluster.PS)
    assert problem is not None
    assert problem.startswith('JAXPS_PS_STANDBY: got "yes"; expected on')
    assert "or off" in problem
    assert cluster.setting_problem("JAXPS_PS_STANDBY", "Off", task_type=cluster.PS) is None
    assert cluster.setting_problem("JAXPS_PS_STANDBY", "yes", task_type="worker") is None


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf", "3601", ""])
def test_a_wrong_standby_delay_is_refused_on_a_ps_naming_what_is_allowed(value: str) -> None:
    problem = cluster.setting_problem("JAXPS_PS_STANDBY_DELAY", value, task_type=cluster.PS)
    assert problem is not None
    assert problem.startswith(f'JAXPS_PS_STANDBY_DELAY: got "{value}"; expected seconds')
    assert "> 0 and <= 3600 (default 10)" in problem
    assert cluster.setting_problem("JAXPS_PS_STANDBY_DELAY", value, task_type="worker") is None


@pytest.mark.parametrize(("value", "seconds"), [("10", 10.0), ("0.5", 0.5), ("3600", 3600.0)])
def test_a_standby_delay_in_range_is_taken(value: str, seconds: float) -> None:
    assert cluster.setting_problem("JAXPS_PS_STANDBY_DELAY", value, task_type=cluster.PS) is None
    assert cluster.seconds_setting(value) == seconds


def _env(result: Any, pod: str) -> dict[str, str]:
    created = {c["metadata"]["name"]: c for c in result.create if c["kind"] == "Pod"}
    return {e["name"]: e.get("value") for e in created[pod]["spec"]["containers"][0]["env"]}


def test_the_operator_turns_the_keeper_on_for_ps_pods_only() -> None:
    result = step(job(ps=2, workers=2), [])
    assert _env(result, "tj-ps-0")[builders.STANDBY_ENV] == "on"
    assert _env(result, "tj-ps-1")[builders.STANDBY_ENV] == "on"
    assert builders.STANDBY_ENV not in _env(result, "tj-worker-0")


def test_a_template_turning_it_off_is_kept() -> None:
    j = with_env(job(ps=1, workers=1), "ps", [{"name": "JAXPS_PS_STANDBY", "value": "off"}])
    ps = next(c for c in step(j, []).create if c["metadata"]["name"] == "tj-ps-0")
    names = [e["name"] for e in ps["spec"]["containers"][0]["env"]]
    assert names.count(builders.STANDBY_ENV) == 1
    assert _env(step(j, []), "tj-ps-0")[builders.STANDBY_ENV] == "off"
    assert keeper.KEEPER_ENV == builders.STANDBY_ENV


def test_oom_kills_are_read_from_the_memory_cgroup_v2_or_v1(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.events", tmp_path / "memory.oom_control"
    v2.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n")
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert keeper.oom_kills([v2, v1]) == 2
    assert keeper.oom_kills([tmp_path / "absent", v1]) == 5
    v1.write_text("oom_kill_disable 0\n")  # a kernel that does not count them
    assert keeper.oom_kills([tmp_path / "absent", v1]) is None


@pytest.mark.parametrize("value", ["0", "soon", "3601"])
def test_a_wrong_loop_grace_is_refused_on_a_worker_and_left_to_a_ps(value: str) -> None:
    problem = cluster.setting_problem("JAXPS_LOOP_GRACE_SECONDS", value, task_type="worker")
    assert problem is not None
    assert problem.startswith(f'JAXPS_LOOP_GRACE_SECONDS: got "{value}"; expected the seconds')
    assert "(default 30)" in problem
    assert cluster.setting_problem("JAXPS_LOOP_GRACE_SECONDS", value, task_type="ps") is None
    assert cluster.setting_problem("JAXPS_LOOP_GRACE_SECONDS", "5", task_type="chief") is None
