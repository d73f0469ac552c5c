"""TensorBoard event files from real jobs: the chief's training curves, the evaluations, and a
chief stopped by SIGTERM closing its file; read back with TensorBoard's own reader."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.process import harness, waiting
from tests.unit.test_summaries import read

pytestmark = pytest.mark.process
TRAINING: dict[str, Any] = {
    "model": {"name": "mlp"},
    "mode": "sync",
    "steps": 600,
    "batchSize": 32,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    "evalEverySteps": 100,
    "logEverySeconds": 0.2,  # several points even where training runs at 300 steps/s
    "heartbeatSeconds": 0.1,
}
TRAIN_TAGS = {
    "loss",
    "steps/s",
    "examples/s",
    "step_seconds/pull",
    "step_seconds/compute",
    "step_seconds/push",
}
LOGGED_STEP = re.compile(r"step (\d+)/\d+  loss \d")  # the chief's log tick, once it has a loss


def steps(points: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in points]


@pytest.mark.parametrize("evaluator", [True, False], ids=["an-evaluator", "the-chief-evaluates"])
def test_a_job_writes_training_curves_and_evaluations_up_to_its_last_step(
    jobs: list[harness.LocalJob], tmp_path: Path, evaluator: bool
) -> None:
    board = tmp_path / "tensorboard"
    training = {**TRAINING, "tensorboard": {"dir": str(board), "flushSeconds": 1}}
    job = harness.LocalJob.start(
        training=training, log_dir=tmp_path / "logs", ps=1, workers=2, evaluator=evaluator
    )
    jobs.append(job)
    codes = job.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    summary = job.summary()
    last = summary["step"]
    assert last == 600

    train = read(board / "train")
    assert set(train) >= TRAIN_TAGS, sorted(train)
    for tag in TRAIN_TAGS:
        ticks = steps(train[tag])
        assert ticks == sorted(set(ticks)), (tag, ticks)  # one point per step, increasing
        assert ticks[-1] == last, (tag, ticks)  # the curves end at the last step
    assert len(train["loss"]) >= 2, train["loss"]
    assert train["loss"][-1][1] < train["loss"][0][1]
    assert train["examples/s"][-1][1] > 0
    assert all(train[f"step_seconds/{phase}"][-1][1] > 0 for phase in ("pull", "compute", "push"))

    evaluated = read(board / "eval")
    assert set(evaluated) >= {"accuracy", "loss"}, sorted(evaluated)
    for tag, points in evaluated.items():
        assert steps(points) == sorted(set(steps(points))), (tag, points)
        assert steps(points)[-1] == last, (tag, points)
        assert points[-1][1] == pytest.approx(summary["eval"][tag], rel=1e-4, abs=1e-5)
    if evaluator:
        assert len(evaluated["accuracy"]) >= 2  # every evalEverySteps, not only the last
    else:
        assert steps(evaluated["accuracy"]) == [last]  # the chief's final evaluation

    chief, writer = "worker-0", "evaluator-0" if evaluator else "worker-0"
    chief_log = (job.log_dir / f"{chief}.log").read_text()
    assert chief_log.count(f"TensorBoard event files in {board / 'train'} ") == 1
    writer_log = (job.log_dir / f"{writer}.log").read_text()
    assert writer_log.count(f"TensorBoard event files in {board / 'eval'} ") == 1
    assert len(list((board / "train").glob("events.out.tfevents.*"))) == 1
    assert len(list((board / "eval").glob("events.out.tfevents.*"))) == 1


def test_a_chief_stopped_by_sigterm_closes_its_event_file(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    """With an hour between flushes, only closing the file puts the last tick on disk."""
    board = tmp_path / "tensorboard"
    training = {
        **TRAINING,
        "steps": 1_000_000,  # trains until the test stops it
        "workerTimeoutSeconds": 60,
        "tensorboard": {"dir": str(board), "flushSeconds": 3600},
        # a point at every step the chief sees move, recorded before its log tick: the last
        # tick's step is then a point (with the default 10, a tick of a slow run, 6 steps past
        # the last multiple of 10, had none: seen on a cold, loaded run)
        "summaryEverySteps": 1,
    }
    job = harness.LocalJob.start(training=training, log_dir=tmp_path / "logs", ps=1, workers=1)
    jobs.append(job)
    chief_log = job.log_dir / "worker-0.log"

    def logged_steps() -> list[int]:
        text = chief_log.read_text() if chief_log.exists() else ""
        return [int(step) for step in LOGGED_STEP.findall(text)]

    waiting.wait_for(
        lambda: len([s for s in logged_steps() if s > 0]) >= 2,
        job,
        timeout=180,
        what="two log ticks of the chief with a loss",
    )
    last = logged_steps()[-1]
    chief = job.processes["worker-0"]
    chief.send_signal(signal.SIGTERM)
    code = chief.wait(timeout=30)  # the ps stays up, for a replacement chief
    assert code == 128 + signal.SIGTERM, f"{code}\n{job.logs()}"

    loss = read(board / "train")["loss"]
    assert last in steps(loss), (last, loss)


def test_the_training_curve_gets_a_point_every_summary_interval_not_every_log_tick(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    """The log tick (`logEverySeconds`, 30 s here) used to set the curve's points: a job of a
    few seconds got one. Now a point each time the global step crosses a multiple of
    `summaryEverySteps`, as the chief sees the step (every 0.1 s here)."""
    board = tmp_path / "tensorboard"
    training = {
        **TRAINING,
        "logEverySeconds": 30,
        "summaryEverySteps": 10,
        "tensorboard": {"dir": str(board), "flushSeconds": 1},
    }
    job = harness.LocalJob.start(training=training, log_dir=tmp_path / "logs", ps=1, workers=2)
    jobs.append(job)
    codes = job.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    ticks = steps(read(board / "train")["steps/s"])
    intervals = [step // 10 for step in ticks]
    assert intervals == sorted(set(intervals)), ticks  # at most one point per interval
    assert ticks[-1] == 600, ticks
    assert len(ticks) >= 4, ticks  # one per interval the chief saw go by, not one per 30 s
