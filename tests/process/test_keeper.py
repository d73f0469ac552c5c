"""A ps run under its keeper (JAXPS_PS_STANDBY=on, as in a ps pod: `process.keeper`): the ps
process killed, the keeper's standby takes over in place and the job succeeds; a SIGTERM stops
the ps cleanly and leaves no standby behind."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.process import harness, waiting
from tests.procfs import children, keepers_ps

pytestmark = pytest.mark.process
Metric = Callable[[int, str], float | None]
# a standby 2 s after the ps starts or a standby takes over (the keeper's default wait is 10 s)
KEEPER = {"JAXPS_PS_STANDBY": "on", "JAXPS_PS_STANDBY_DELAY": "2"}
TRAINING: dict[str, Any] = {
    "model": {"name": "mlp", "kwargs": {"hidden": [64]}},
    "dataset": {"name": "digits"},
    "mode": "async",
    "steps": 4_000,  # a checkpoint, then two kills, each after a standby loaded (seen by 700)
    "batchSize": 32,
    "seed": 0,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    "heartbeatSeconds": 0.25,
    "workerTimeoutSeconds": 5,
    "logEverySeconds": 2,
}


def test_a_killed_ps_process_is_taken_over_by_its_pods_standby_and_the_job_succeeds(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric
) -> None:
    training = {**TRAINING, "checkpoint": {"dir": str(tmp_path / "ckpt"), "everySteps": 50}}
    job = harness.LocalJob.start(
        training=training, log_dir=tmp_path / "logs", task_env={"ps-0": KEEPER}
    )
    jobs.append(job)
    keeper = job.processes["ps-0"]
    port = job.metrics_ports["worker-0"]
    waiting.wait_for(
        lambda: (metric(port, "jaxps_last_checkpoint_step") or 0) >= 50, job, what="checkpoint"
    )
    for kill in (1, 2):  # the second by the standby started after the first took over
        waiting.wait_for(lambda: keepers_ps(keeper.pid) is not None, job, what="ps-0's standby")
        ps = keepers_ps(keeper.pid)
        assert ps is not None
        os.kill(ps, signal.SIGKILL)
        waiting.wait_for(
            lambda kill=kill: (metric(port, "jaxps_recoveries_total") or 0) >= kill,  # type: ignore[misc]
            job,
            what=f"recovery {kill}",
        )
    codes = job.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    assert job.processes["ps-0"] is keeper  # the same pod: nothing was started again
    summary = job.summary()
    assert summary["step"] == TRAINING["steps"]
    assert len(summary["recoveries"]) == 2, summary
    print(f"ps-0 taken over in its pod twice: recoveries {summary['recoveries']}")
    assert summary["eval"]["accuracy"] >= 0.9
    log = (tmp_path / "logs" / "ps-0.log").read_text()
    assert "ps killed (signal 9); the standby took over (4 more this pod)" in log
    assert "ps killed (signal 9); the standby took over (3 more this pod)" in log
    assert "started from the job's standby, loaded ahead" in log
    assert children(keeper.pid) == {}


def test_a_sigterm_stops_the_keepers_ps_and_its_standby(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    job = harness.LocalJob.start(
        training={**TRAINING, "steps": 100_000},
        log_dir=tmp_path,
        task_env={"ps-0": KEEPER},
        order=["ps-0"],
    )
    jobs.append(job)
    keeper = job.processes["ps-0"]
    waiting.wait_for(lambda: keepers_ps(keeper.pid) is not None, job, what="ps-0's standby")
    started = children(keeper.pid)
    keeper.send_signal(signal.SIGTERM)
    assert keeper.wait(timeout=60) == 143  # the ps stopped by SIGTERM: 128 + 15, passed on
    assert all(not Path(f"/proc/{pid}").exists() for pid in started)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"JAXPS_PS_STANDBY": "maybe"}, 'JAXPS_PS_STANDBY: got "maybe"; expected on'),
        (
            {"JAXPS_PS_STANDBY": "on", "JAXPS_PS_STANDBY_DELAY": "soon"},
            'JAXPS_PS_STANDBY_DELAY: got "soon"; expected seconds',
        ),
    ],
    ids=["standby", "standby-delay"],
)
def test_a_wrong_setting_is_refused_naming_it(
    tmp_path: Path, env: dict[str, str], said: str
) -> None:
    job = harness.LocalJob.start(
        training=TRAINING,
        log_dir=tmp_path,
        task_env={"ps-0": env},
        order=["ps-0"],
    )
    try:
        assert job.processes["ps-0"].wait(timeout=60) == 2
    finally:
        job.stop()
    assert said in (tmp_path / "ps-0.log").read_text()
