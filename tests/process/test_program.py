"""The user's own training loop (`training.program`, `jaxps_runtime.train.program`) on real
processes: the ported TF1 trainer learns as well as the built-in loop, a GAN trains two networks
in turns, and a ps, a worker and the chief killed under a user's loop leave a job that succeeds."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.process import harness, waiting

pytestmark = pytest.mark.process
Metric = Callable[[int, str], float | None]
PROGRAMS = Path(__file__).resolve().parents[2] / "examples" / "programs"
TEST_PROGRAMS = Path(__file__).resolve().parent / "programs"
ENV = {"PYTHONPATH": os.pathsep.join([str(PROGRAMS), str(TEST_PROGRAMS)])}
BASE: dict[str, Any] = {
    "dataset": {"name": "digits"},
    "mode": "sync",
    "steps": 300,
    "batchSize": 32,
    "seed": 0,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    "heartbeatSeconds": 0.25,
    "workerTimeoutSeconds": 5,
    "logEverySeconds": 2,
}


def _run(jobs: list[harness.LocalJob], tmp: Path, training: dict[str, Any], **kw: Any) -> Any:
    job = harness.LocalJob.start(training=training, log_dir=tmp, extra_env=ENV, **kw)
    jobs.append(job)
    codes = job.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    return job.summary()


def test_the_ported_tf1_trainer_learns_as_well_as_the_built_in_loop(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    builtin = _run(
        jobs, tmp_path / "builtin", {**BASE, "model": {"name": "mlp", "kwargs": {"hidden": [64]}}}
    )
    ported = _run(jobs, tmp_path / "ported", {**BASE, "program": "tf1_mnist:main"})
    assert ported["step"] == BASE["steps"]
    assert ported["eval"]["accuracy"] >= 0.9
    assert ported["eval"]["accuracy"] >= builtin["eval"]["accuracy"] - 0.03, (ported, builtin)
    # its LoggingHook (every 100 steps) logged on each worker
    for worker in ("worker-0", "worker-1"):
        assert " global step 200, loss " in (tmp_path / "ported" / f"{worker}.log").read_text()


@pytest.mark.parametrize(
    "mode",
    [{"mode": "async"}, {"mode": "boundedStaleness", "maxStaleness": 2}],
    ids=["async", "bounded-staleness"],
)
def test_the_ported_tf1_trainer_learns_in_every_mode(
    jobs: list[harness.LocalJob], tmp_path: Path, mode: dict[str, Any]
) -> None:
    summary = _run(jobs, tmp_path, {**BASE, **mode, "program": "tf1_mnist:main"})
    assert summary["step"] == BASE["steps"]
    assert summary["eval"]["accuracy"] >= 0.9, summary


def test_a_gan_trains_its_two_networks_in_turns_each_with_its_own_optimizer_state(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    training = {
        **BASE,
        "program": "gan:main",
        "mode": "async",
        "steps": 3000,
        "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.002, "b1": 0.5}},
    }
    summary = _run(jobs, tmp_path, training, chief=True)
    assert summary["step"] == 3000
    # the generator starts near 0; the real data's mean is 4
    assert summary["eval"]["mean_error"] < 1.0, summary


def _kill_and_restart(job: harness.LocalJob, task: str) -> None:
    job.processes[task].send_signal(signal.SIGKILL)
    assert job.processes[task].wait(timeout=30) == -signal.SIGKILL
    job.start_task(task, metrics_port=job.metrics_ports[task])


def test_a_ps_a_worker_and_the_chief_killed_under_a_users_loop_and_the_job_succeeds(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric
) -> None:
    steps = 1200
    training = {
        **BASE,
        "program": "tf1_mnist:main",
        "steps": steps,
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "everySteps": 50, "keep": 3},
    }
    job = harness.LocalJob.start(
        training=training, log_dir=tmp_path / "logs", extra_env=ENV, chief=True
    )
    jobs.append(job)

    def step() -> float:
        return metric(job.metrics_ports["chief-0"], "jaxps_global_step") or 0.0

    for at, task in ((150, "chief-0"), (450, "ps-1"), (750, "worker-1")):
        waiting.wait_for(lambda at=at: step() >= at, job, what=f"step {at}")  # type: ignore[misc]
        _kill_and_restart(job, task)
    codes = job.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    summary = job.summary()
    assert summary["step"] == steps
    assert len(summary["recoveries"]) >= 1  # the ps: restored from the last checkpoint
    assert summary["eval"]["accuracy"] >= 0.9


def test_a_variable_with_an_optimizer_of_its_own_is_updated_by_it_through_a_ps_restore(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric
) -> None:
    """`b` has SGD at learning rate 1e-12 (tests/process/programs/frozen.py), `w` the job's adam: a
    ps lost at step 150 is restored from a checkpoint that holds each one's optimizer state."""
    training = {
        **BASE,
        "program": "frozen:main",
        "dataset": {"name": "synthetic", "kwargs": {"features": 8}},
        "mode": "async",
        "steps": 600,
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "everySteps": 50, "keep": 3},
        "exportPath": str(tmp_path / "export.npz"),
    }
    job = harness.LocalJob.start(
        training=training, log_dir=tmp_path / "logs", extra_env=ENV, chief=True
    )
    jobs.append(job)
    chief = job.metrics_ports["chief-0"]
    waiting.wait_for(lambda: (metric(chief, "jaxps_global_step") or 0) >= 150, job, what="step 150")
    _kill_and_restart(job, "ps-0")
    codes = job.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    summary = job.summary()
    assert summary["step"] == 600
    assert len(summary["recoveries"]) == 1, summary
    with np.load(tmp_path / "export.npz") as exported:
        assert float(exported["['b']"]) == 0.5  # frozen.B0, exactly
        assert np.abs(exported["['w']"]).max() > 0.1  # trained from zeros
    assert "optimizer" in (tmp_path / "logs" / "ps-0.log").read_text()


def test_a_users_loop_reads_and_updates_an_embedding_table_by_rows_with_its_own_optimizer(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    """tests/process/programs/tables.py: the built-in embedding model as a user's loop, the
    table pulled and pushed by rows and updated by adagrad, the dense layer by the job's adam."""
    training = {
        **BASE,
        "program": "tables:main",
        "dataset": {"name": "sparse"},
        "mode": "async",
        "steps": 1000,
        "batchSize": 64,
    }
    summary = _run(jobs, tmp_path, training)
    assert summary["step"] == 1000
    print(f"embedding table by rows: {summary['eval']}, {summary['stepsPerSecond']} steps/s")
    assert summary["eval"]["accuracy"] >= 0.75, summary
    ps_logs = "".join((tmp_path / f"ps-{i}.log").read_text() for i in range(2))
    assert "updated by rows" in ps_logs
