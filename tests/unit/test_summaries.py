"""TensorBoard event files: written by `summaries.Writer`, read back by TensorBoard's own reader."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import (
    event_accumulator,
)

from jaxps_runtime.config.training import TensorBoardConfig
from jaxps_runtime.train import summaries


def read(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under `run` by tag, as (step, value), the way TensorBoard loads them."""
    accumulator = event_accumulator.EventAccumulator(str(run))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def wait_for(condition: Callable[[], bool], *, timeout: float = 30, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_scalars_read_back_with_their_tags_steps_and_values(tmp_path: Path) -> None:
    config = TensorBoardConfig(dir=str(tmp_path))
    writer = summaries.Writer(config, run=summaries.TRAIN, task="chief-0")
    for step in (10, 20, 30):
        writer.scalars(
            {summaries.LOSS: 1.0 / step, summaries.STEPS_PER_SECOND: 2.5 * step}, step=step
        )
    writer.scalars(summaries.step_seconds({"pull": 0.25, "compute": 0.5, "push": 0.125}), step=30)
    writer.close()

    scalars = read(tmp_path / "train")
    assert set(scalars) == {
        "loss",
        "steps/s",
        "step_seconds/pull",
        "step_seconds/compute",
        "step_seconds/push",
    }
    assert [step for step, _ in scalars["loss"]] == [10, 20, 30]
    assert [value for _, value in scalars["loss"]] == pytest.approx([0.1, 0.05, 1 / 30])
    assert scalars["steps/s"] == [(10, 25.0), (20, 50.0), (30, 75.0)]
    assert scalars["step_seconds/compute"] == [(30, 0.5)]


def test_events_are_on_disk_within_flush_seconds_while_the_writer_stays_open(
    tmp_path: Path,
) -> None:
    """What was flushed survives a SIGKILL: it is in the file before any close."""
    writer = summaries.Writer(
        TensorBoardConfig(dir=str(tmp_path), flushSeconds=1), run=summaries.EVAL, task="evaluator-0"
    )
    try:
        writer.scalars({"accuracy": 0.5}, step=100)
        wait_for(
            lambda: (
                (tmp_path / "eval").is_dir()
                and read(tmp_path / "eval").get("accuracy") == [(100, 0.5)]
            ),
            what="the accuracy at step 100 on disk",
        )
    finally:
        writer.close()


def test_a_replacement_appends_a_file_and_a_rollback_drops_the_undone_points(
    tmp_path: Path,
) -> None:
    config = TensorBoardConfig(dir=str(tmp_path))
    first = summaries.Writer(config, run=summaries.TRAIN, task="chief-0")
    for step in (10, 20, 30):
        first.scalars({"loss": float(step)}, step=step)
    first.close()
    # A replacement chief restored the checkpoint of step 20: the point at 30 was undone.
    second = summaries.Writer(config, run=summaries.TRAIN, task="chief-0")
    second.restarted(step=20)
    second.scalars({"loss": 21.0}, step=20)
    second.scalars({"loss": 41.0}, step=40)
    second.close()

    assert len(list((tmp_path / "train").glob("events.out.tfevents.*"))) == 2
    assert read(tmp_path / "train")["loss"] == [(10, 10.0), (20, 21.0), (40, 41.0)]


def test_an_unwritable_directory_warns_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    caplog.set_level(logging.WARNING, logger=summaries.__name__)
    writer = summaries.Writer(
        TensorBoardConfig(dir=str(blocker / "tb")), run=summaries.TRAIN, task="chief-0"
    )
    wait_for(lambda: not writer.active, what="the writer to give up")
    for step in range(5):
        writer.scalars({"loss": 1.0}, step=step)
    writer.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "chief-0: TensorBoard: cannot write event files in" in warnings[0]
    assert "training goes on" in warnings[0]


def test_without_a_directory_nothing_is_written_and_no_thread_runs(tmp_path: Path) -> None:
    writer = summaries.Writer(None, run=summaries.TRAIN, task="chief-0")
    writer.scalars({"loss": 1.0}, step=1)
    writer.restarted(step=0)
    writer.close()
    assert not writer.active
    assert writer.file is None
    assert list(tmp_path.iterdir()) == []


def test_close_is_idempotent_and_later_scalars_are_ignored(tmp_path: Path) -> None:
    writer = summaries.Writer(
        TensorBoardConfig(dir=str(tmp_path)), run=summaries.EVAL, task="chief-0"
    )
    writer.scalars({"accuracy": 0.75}, step=1)
    writer.close()
    writer.close()
    writer.scalars({"accuracy": 1.0}, step=2)
    assert read(tmp_path / "eval") == {"accuracy": [(1, 0.75)]}
    assert writer.file is not None
    assert Path(writer.file).parent == tmp_path / "eval"
