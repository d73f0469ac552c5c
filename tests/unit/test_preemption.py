"""A preempted chief's last checkpoint (`chief.preemption`): its deadline, the step it saves
at, which stops it answers, and the periodic checkpoint a SIGTERM leaves to it. No processes,
no network: the task, the checkpointer and the ps client are stand-ins."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.process import stopping
from jaxps_runtime.train import checkpoint
from jaxps_runtime.train.chief import preemption
from jaxps_runtime.train.chief.checkpointer import Checkpointer
from jaxps_runtime.train.task import Task


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        pytest.param(None, preemption.DEFAULT_SECONDS, id="unset"),
        pytest.param("", preemption.DEFAULT_SECONDS, id="empty"),
        pytest.param("12.5", 12.5, id="seconds"),
        pytest.param("0", 0.0, id="off"),
    ],
)
def test_the_deadline_comes_from_the_environment(raw: str | None, seconds: float) -> None:
    environ = {} if raw is None else {preemption.ENV: raw}
    assert preemption.seconds(environ) == seconds


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_deadline_that_is_no_number_of_seconds_is_the_default_with_a_warning(
    raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert preemption.seconds({preemption.ENV: raw}) == preemption.DEFAULT_SECONDS
    assert preemption.ENV in caplog.text


@pytest.mark.parametrize(
    ("steps", "settled", "avoid", "step"),
    [
        pytest.param([40, 40], True, None, 40, id="settled-the-step-every-ps-holds"),
        pytest.param([40, 41], False, None, 42, id="moving-the-next-step-past-the-furthest"),
        pytest.param([40, 40], False, 41, 42, id="never-an-abandoned-save's-step"),
    ],
)
def test_the_step_saved_at(steps: list[int], settled: bool, avoid: int | None, step: int) -> None:
    assert preemption.target(steps, settled=settled, avoid=avoid) == step


class StuckClient:
    """A ps client whose Save waits for a step that never comes, until its stop."""

    def __init__(self, stop: stopping.Stop) -> None:
        self.stop = stop
        self.epoch, self.incarnations = 0, [0]
        self.closed = False

    def save(self, **_: object) -> list[object]:
        self.stop.wait()
        raise stopping.Stopped("the Save ended")

    def close(self) -> None:
        self.closed = True


class Tier:
    """Two ps READY at epoch 1 (incarnations 7 and 8) at `steps`, as a ps client sees them;
    Save answers at once at the step every ps holds, and is refused at any other."""

    def __init__(self, steps: list[int], *, state: ps_pb2.PsState = ps_pb2.READY) -> None:
        self.steps, self.state = steps, state
        self.epoch, self.incarnations = 1, [7, 8]
        self.saved: list[int] = []
        self.closed = False

    def _id(self, ps: int) -> tensor_pb2.Identity:
        return tensor_pb2.Identity(ps_incarnation=7 + ps, cluster_epoch=1)

    def statuses(self, *, timeout: float) -> list[ps_pb2.StatusReply]:
        return [
            ps_pb2.StatusReply(id=self._id(i), state=self.state, step=step)
            for i, step in enumerate(self.steps)
        ]

    def save(self, *, step: int, directory: str, timeout: float) -> list[ps_pb2.CheckpointReply]:
        assert set(self.steps) == {step}, f"Save at {step}, the ps are at {self.steps}"
        self.saved.append(step)
        return [
            ps_pb2.CheckpointReply(id=self._id(i), step=step, file=f"{directory}/ps-{i}.npz")
            for i in range(len(self.steps))
        ]

    def close(self) -> None:
        self.closed = True


def _task(root: Path | None, tier: Tier | None = None) -> tuple[Task, list[StuckClient | Tier]]:
    """A chief's task as the checkpointer and the preemption use it; the ps clients it made
    (each a `StuckClient`, or `tier`)."""
    clients: list[StuckClient | Tier] = []

    def ps_client(*, stop: stopping.Stop) -> StuckClient | Tier:
        clients.append(tier or StuckClient(stop))
        return clients[-1]

    checkpoint = SimpleNamespace(
        dir=str(root) if root else None, everySteps=100, everySeconds=None, keep=3
    )
    training = SimpleNamespace(
        checkpoint=checkpoint,
        optimizer=SimpleNamespace(to_json=lambda: "{}"),
        mode="sync",
        workerTimeoutSeconds=10.0,
        steps=1000,
    )
    task: Any = SimpleNamespace(
        stop=stopping.Stop(),
        training=training,
        placement=SimpleNamespace(to_dict=dict),
        ps_client=ps_client,
        metrics=SimpleNamespace(last_checkpoint_step=SimpleNamespace(set=lambda _: None)),
    )
    return cast(Task, task), clients


@pytest.mark.parametrize(
    ("signum", "keeps"),
    [
        pytest.param(signal.SIGTERM, True, id="sigterm-leaves-it-to-the-preemption"),
        pytest.param(signal.SIGINT, False, id="sigint-ends-it"),
    ],
)
def test_a_stop_ends_the_periodic_checkpoint_in_flight_unless_it_is_a_preemption(
    tmp_path: Path, signum: signal.Signals, keeps: bool
) -> None:
    task, clients = _task(tmp_path)
    checkpointer = Checkpointer(task, keep_on_sigterm=True)
    checkpointer.start(step=100, epoch=1, incarnations=[0])
    assert checkpointer.in_flight == 100
    task.stop.request(signum)
    assert checkpointer.wait(timeout=0.5) is not keeps
    checkpointer.abandon()  # what the chief does on its way out, whatever the stop
    assert checkpointer.in_flight is None
    assert all(c.closed for c in clients)


def test_a_checkpointer_not_told_to_keep_it_ends_it_on_sigterm_too(tmp_path: Path) -> None:
    task, _ = _task(tmp_path)
    checkpointer = Checkpointer(task)
    checkpointer.start(step=100, epoch=1, incarnations=[0])
    task.stop.request(signal.SIGTERM)
    assert checkpointer.wait(timeout=10)


@dataclass(frozen=True)
class Stopped:
    """How a chief stopped, and what its preemption logs (None: nothing)."""

    signum: signal.Signals
    said: str | None
    checkpoint_dir: bool = True
    brought_up: bool = True


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Stopped(signal.SIGINT, None), id="sigint-nothing"),
        pytest.param(
            Stopped(
                signal.SIGTERM,
                "preempted (SIGTERM): no checkpoint: training.checkpoint.dir is not set",
                checkpoint_dir=False,
            ),
            id="no-checkpoint-dir",
        ),
        pytest.param(
            Stopped(
                signal.SIGTERM,
                "preempted (SIGTERM): no checkpoint: the ps tier was not brought up yet",
                brought_up=False,
            ),
            id="no-ps-tier-yet",
        ),
    ],
)
def test_a_stopped_chief_says_why_it_writes_no_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: Stopped
) -> None:
    task, clients = _task(tmp_path if case.checkpoint_dir else None)
    checkpointer = Checkpointer(task, keep_on_sigterm=True)
    preempted = preemption.Preemption(task, checkpointer=checkpointer, seconds=20)
    task.stop.request(case.signum)
    with caplog.at_level(logging.INFO, logger=preemption.__name__):
        preempted.run(cast(Any, SimpleNamespace()), brought_up=case.brought_up)
    lines = [r.getMessage() for r in caplog.records if r.name == preemption.__name__]
    assert lines == ([case.said] if case.said else [])
    assert clients == []  # no ps was asked anything
    assert not list(tmp_path.iterdir())


def _preempt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, tier: Tier, *, last_step: int | None = None
) -> list[str]:
    """A chief with a checkpoint directory (its last committed checkpoint `last_step`) gets
    SIGTERM with the ps tier at `tier`; what it logs of it."""
    task, _ = _task(tmp_path, tier)
    checkpointer = Checkpointer(task, keep_on_sigterm=True)
    checkpointer.last_step = last_step
    preempted = preemption.Preemption(task, checkpointer=checkpointer, seconds=20)
    task.stop.request(signal.SIGTERM)
    client = SimpleNamespace(epoch=1, incarnations=[7, 8])
    with caplog.at_level(logging.INFO, logger=preemption.__name__):
        preempted.run(cast(Any, client), brought_up=True)
    assert tier.closed
    return [r.getMessage() for r in caplog.records if r.name == preemption.__name__]


def test_a_preempted_chief_commits_the_step_the_ps_tier_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = Tier([40, 40])
    (line,) = _preempt(tmp_path, caplog, tier)
    assert line.startswith("preempted (SIGTERM): checkpoint of step 40 committed in ")
    assert tier.saved == [40]
    assert [m.step for m in checkpoint.committed(tmp_path)] == [40]


def test_a_step_already_committed_is_not_saved_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint.commit(
        tmp_path,
        checkpoint.Manifest(
            step=40, epoch=1, placement={}, optimizer="{}", mode="sync", cursors={}, shards=[]
        ),
    )
    tier = Tier([40, 40])
    lines = _preempt(tmp_path, caplog, tier, last_step=40)
    assert lines == [
        "preempted (SIGTERM): no new checkpoint: the one of step 40 is already committed"
    ]
    assert tier.saved == []


def test_a_ps_tier_not_ready_at_the_chiefs_epoch_is_not_saved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = Tier([40, 40], state=ps_pb2.ASSIGNING)
    lines = _preempt(tmp_path, caplog, tier)
    assert lines == ["preempted (SIGTERM): no checkpoint: ps-0 is ASSIGNING at epoch 1"]
    assert tier.saved == []
    assert not checkpoint.committed(tmp_path)


def test_a_file_left_by_a_ps_that_died_writing_is_no_reason_to_wait(tmp_path: Path) -> None:
    directory = checkpoint.step_dir(tmp_path, 40)
    directory.mkdir()
    left = directory / "ps-0.npz.tmp"
    left.write_bytes(b"half")
    os.utime(left, (0, 0))
    stopped = stopping.Stop()
    stopped.request()  # any wait would raise Stopped at once
    preemption.Preemption._quiet(tmp_path, 40, stopped)
