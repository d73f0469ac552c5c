"""Fault tolerance, with real processes killed by SIGKILL and started again."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.client import psclient
from jaxps_runtime.ps import shardfile
from jaxps_runtime.train import checkpoint
from jaxps_runtime.wire import rpc
from tests.process import harness, waiting

pytestmark = pytest.mark.process
Metric = Callable[[int, str], float | None]
EVERY = 50
TRAINING: dict[str, Any] = {
    "model": {"name": "mlp"},
    "mode": "sync",
    "steps": 500,
    "batchSize": 32,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    "checkpoint": {"everySteps": EVERY, "keep": 3},
    "heartbeatSeconds": 0.25,
    "workerTimeoutSeconds": 5,
    "logEverySeconds": 2,
}


def _training(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    return {
        **TRAINING,
        "checkpoint": {**TRAINING["checkpoint"], "dir": str(tmp_path / "ckpt")},
        **changes,
    }


def _start(jobs: list[harness.LocalJob], **kwargs: Any) -> harness.LocalJob:
    """Starts a local job; the `jobs` fixture stops it after the test."""
    job = harness.LocalJob.start(**kwargs)
    jobs.append(job)
    return job


def _finish(job: harness.LocalJob, *, timeout: float = 300) -> dict[str, Any]:
    codes = job.wait(timeout=timeout)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    return job.summary()


def _step(job: harness.LocalJob, metric: Metric, task: str) -> float:
    return metric(job.metrics_ports[task], "jaxps_global_step") or 0.0


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job with nothing killed: what a disturbed run is compared with."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    job = harness.LocalJob.start(training=_training(tmp), log_dir=tmp / "logs")
    try:
        return _finish(job)
    finally:
        job.stop()


def _kill_and_restart(job: harness.LocalJob, task: str) -> None:
    job.processes[task].send_signal(signal.SIGKILL)
    assert job.processes[task].wait(timeout=30) == -signal.SIGKILL
    job.start_task(task, metrics_port=job.metrics_ports[task])


def test_a_killed_ps_is_restarted_and_every_shard_rolls_back_to_the_last_checkpoint(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric, undisturbed: dict[str, Any]
) -> None:
    kept = {"everySteps": EVERY, "keep": 20, "dir": str(tmp_path / "ckpt")}  # none pruned
    job = _start(
        jobs,
        training=_training(tmp_path, checkpoint=kept),
        log_dir=tmp_path / "logs",
        standby=True,
    )
    assert job.standby is not None
    loaded_ahead = job.standby.process
    waiting.wait_for(
        lambda: (
            _step(job, metric, "worker-0") >= 170 and bool(checkpoint.committed(tmp_path / "ckpt"))
        ),
        job,
        what="step 170 and a committed checkpoint",
    )
    newest_committed = checkpoint.committed(tmp_path / "ckpt")[0].step
    killed_at = _step(job, metric, "worker-0")
    _kill_and_restart(job, "ps-0")
    # the restarted ps is the standby, which took ps-0's address, log and credentials; a new
    # standby waits for the next one
    assert job.processes["ps-0"] is loaded_ahead
    assert job.standby is not None
    assert job.standby.process is not loaded_ahead
    next_standby = job.standby.process
    summary = _finish(job)
    assert "started from the job's standby" in (tmp_path / "logs" / "ps-0.log").read_text()
    job.stop()
    assert next_standby.poll() is not None  # never taken: ended with the job
    assert summary["step"] == TRAINING["steps"]
    assert abs(summary["eval"]["accuracy"] - undisturbed["eval"]["accuracy"]) <= 0.01
    [recovery] = summary["recoveries"]
    assert "ps-0" in recovery["reason"]
    # Back to the last committed checkpoint: never behind the newest one committed before the
    # kill. How far behind the killed step that is depends on how fast the machine trains while
    # a checkpoint is written (one not committed at the kill is never restored), not a count of
    # intervals: a loaded machine trains past several before one is committed.
    assert newest_committed <= recovery["toStep"] <= killed_at, (newest_committed, recovery)
    assert recovery["toStep"] % EVERY == 0, recovery
    # The data went back with the parameters: each worker read on from the checkpoint's cursor
    # for it (the batches whose updates the rollback undid are used again, once).
    [restored] = [
        m for m in checkpoint.committed(tmp_path / "ckpt") if m.step == recovery["toStep"]
    ]
    for worker in ("worker-0", "worker-1"):
        log = (tmp_path / "logs" / f"{worker}.log").read_text()
        again = [line for line in log.splitlines() if "ps tier ready again" in line]
        assert again, log[-2000:]
        assert f"data from batch {restored.cursors[worker]}" in again[-1], (again, restored)


def _ps_cursors(job: harness.LocalJob) -> dict[str, int]:
    """The workers' data cursors the ps tasks report in Status (highest over the ps)."""
    replies = []
    for address in job.spec["ps"]:
        with rpc.channel(address) as channel:
            call = rpc.PARAMETER_SERVER.callables(channel)["Status"]
            replies.append(call(ps_pb2.StatusRequest(), timeout=10))
    return psclient.merged_cursors(replies, how=max)


def _resumed_from(log: str) -> list[int]:
    """The batch each start of a worker went on from, from its log."""
    return [
        int(line.rsplit("from batch ", 1)[1].split()[0])
        for line in log.splitlines()
        if "ps ready at step" in line
    ]


def test_a_killed_worker_comes_back_where_its_data_left_off(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric, undisturbed: dict[str, Any]
) -> None:
    job = _start(jobs, training=_training(tmp_path), log_dir=tmp_path / "logs")
    waiting.wait_for(lambda: _step(job, metric, "worker-1") >= 150, job, what="step 150")
    job.processes["worker-1"].send_signal(signal.SIGKILL)
    assert job.processes["worker-1"].wait(timeout=30) == -signal.SIGKILL
    # What the ps tier counted of worker-1's batches: with it dead, nothing changes that.
    used = _ps_cursors(job)["worker-1"]
    assert used > 0
    job.start_task("worker-1", metrics_port=job.metrics_ports["worker-1"])
    summary = _finish(job)
    assert summary["step"] == TRAINING["steps"]
    assert abs(summary["eval"]["accuracy"] - undisturbed["eval"]["accuracy"]) <= 0.01
    # It went on with exactly the batch after the last one whose gradient reached the ps:
    # none used twice, none skipped (not "about where its last heartbeat said").
    assert _resumed_from((tmp_path / "logs" / "worker-1.log").read_text()) == [0, used]


def test_a_restarted_chief_adopts_the_live_state_and_the_step_never_goes_back(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric, undisturbed: dict[str, Any]
) -> None:
    job = _start(jobs, training=_training(tmp_path), log_dir=tmp_path / "logs", chief=True)
    waiting.wait_for(lambda: _step(job, metric, "chief-0") >= 150, job, what="step 150")
    killed_at = _step(job, metric, "chief-0")
    _kill_and_restart(job, "chief-0")
    summary = _finish(job)
    assert summary["step"] == TRAINING["steps"]
    assert summary["startedFrom"]["how"] == "adopted"
    assert summary["startedFrom"]["step"] >= killed_at
    assert summary["recoveries"] == []
    assert abs(summary["eval"]["accuracy"] - undisturbed["eval"]["accuracy"]) <= 0.01


def test_a_ps_killed_while_writing_a_checkpoint_leaves_it_uncommitted(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    slow_saves = {"ps-0": {shardfile.FAILPOINT_SAVE_SLEEP: "3"}}
    # Long enough that the second checkpoint, 3 s after the first, is not the final one.
    steps = 4000
    job = _start(
        jobs,
        training=_training(tmp_path, steps=steps),
        log_dir=tmp_path / "logs",
        task_env=slow_saves,
    )
    waiting.wait_for(lambda: len(checkpoint.committed(root)) >= 1, job, what="a first checkpoint")
    first = checkpoint.committed(root)[0].step
    waiting.wait_for(
        lambda: any(p.parent.name != f"step-{first:09d}" for p in root.glob("step-*/ps-0.npz.tmp")),
        job,
        what="ps-0 writing its second checkpoint",
    )
    [partial] = [
        p for p in root.glob("step-*/ps-0.npz.tmp") if p.parent.name != f"step-{first:09d}"
    ]
    writing = int(partial.parent.name.removeprefix("step-"))
    job.processes["ps-0"].send_signal(signal.SIGKILL)
    job.processes["ps-0"].wait(timeout=30)
    assert not checkpoint.manifest_path(root, writing).exists()
    job.start_task("ps-0", metrics_port=job.metrics_ports["ps-0"])  # without the failpoint
    summary = _finish(job)
    [recovery] = summary["recoveries"]
    assert recovery["toStep"] == first  # the previous committed checkpoint, not the broken one
    assert summary["step"] == steps
    assert summary["checkpointError"] is None


def test_a_ps_killed_during_the_final_checkpoint_still_gives_the_trained_result(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    steps = 200
    training = _training(tmp_path, steps=steps, checkpoint={"dir": str(root), "everySteps": 10_000})
    slow_saves = {"ps-0": {shardfile.FAILPOINT_SAVE_SLEEP: "3"}}
    job = _start(jobs, training=training, log_dir=tmp_path / "logs", task_env=slow_saves)
    final = root / f"step-{steps:09d}" / "ps-0.npz.tmp"
    waiting.wait_for(final.exists, job, what="ps-0 writing the final checkpoint")
    job.processes["ps-0"].send_signal(signal.SIGKILL)
    codes = job.wait(timeout=120)
    assert codes.pop("ps-0") == -signal.SIGKILL
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    summary = job.summary()
    assert summary["step"] == steps
    assert summary["eval"]["accuracy"] > 0.5  # evaluated from the values the chief pulled
    assert f"final checkpoint (step {steps}) failed" in summary["checkpointError"]
    assert summary["lastCheckpointStep"] is None
    assert not checkpoint.committed(root)


def test_a_corrupted_shard_file_is_named_and_the_previous_checkpoint_is_used(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    first = _start(jobs, training=_training(tmp_path, steps=160), log_dir=tmp_path / "first")
    _finish(first)
    manifests = checkpoint.committed(tmp_path / "ckpt")
    assert manifests[0].step == 160
    newest, previous = manifests[0], manifests[1]
    damaged = Path(next(r.file for r in newest.shards if r.ps == 0))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    second = _start(jobs, training=_training(tmp_path, steps=220), log_dir=tmp_path / "second")
    summary = _finish(second)
    assert summary["startedFrom"] == {"how": "restored", "step": previous.step}
    assert summary["step"] == 220
    log = (tmp_path / "second" / "worker-0.log").read_text()
    assert f"checkpoint file {damaged} is corrupt" in log


def test_a_checkpoint_of_another_placement_is_refused_with_a_clear_error(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    first = _start(jobs, training=_training(tmp_path, steps=60), log_dir=tmp_path / "first")
    _finish(first)
    second = _start(jobs, training=_training(tmp_path, steps=80), log_dir=tmp_path / "second", ps=1)
    # Only the chief (worker-0) ends: the ps stays up for a replacement chief, as it should,
    # and the `jobs` fixture stops it (waiting for every process here took 120 s).
    code = second.processes["worker-0"].wait(timeout=120)
    assert code == 1, second.logs()
    assert (
        "placement.numPs is 2, the job has 1" in (tmp_path / "second" / "worker-0.log").read_text()
    )


def test_tasks_started_in_reverse_order_still_train(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    training = {**_training(tmp_path, steps=200), "checkpoint": {}}
    job = _start(jobs, training=training, log_dir=tmp_path / "logs", order=["worker-1", "worker-0"])
    chief_log = tmp_path / "logs" / "worker-0.log"
    waiting.wait_for(
        lambda: chief_log.exists() and "waiting for 2 ps" in chief_log.read_text(),
        job,
        what="the chief waiting for the ps",
    )
    for name in ("ps-1", "ps-0"):
        job.start_task(name, metrics_port=job.metrics_ports[name])
    summary = _finish(job)
    assert summary["step"] == 200
    assert summary["eval"]["accuracy"] >= 0.9


def test_a_ps_that_never_comes_is_reported_by_name_when_the_startup_timeout_ends(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    training = {**_training(tmp_path, steps=10), "startupTimeoutSeconds": 3, "checkpoint": {}}
    job = _start(
        jobs, training=training, log_dir=tmp_path / "logs", workers=1, order=["ps-0", "worker-0"]
    )
    codes = {name: job.processes[name].wait(timeout=120) for name in ("worker-0",)}
    assert codes == {"worker-0": 1}
    log = (tmp_path / "logs" / "worker-0.log").read_text()
    assert f"no answer from ps-1 at {job.spec['ps'][1]}" in log
