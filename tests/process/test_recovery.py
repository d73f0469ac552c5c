"""Fault tolerance, with real processes killed by SIGKILL and started again."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.client import psclient
from jaxps_runtime.config import training as config
from jaxps_runtime.data import builtin
from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.ps import shardfile
from jaxps_runtime.train import checkpoint
from jaxps_runtime.wire import rpc
from tests.process import harness, waiting

# one pytest-xdist worker runs the whole module: its module-scoped processes start once
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("test_recovery")]
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
    # The data went back with the parameters: each ps kept its own data positions in its part
    # of the checkpoint, restored them, and the chief's shard queue started over from them (the
    # batches whose updates the rollback undid are leased again, once).
    [restored] = [
        m for m in checkpoint.committed(tmp_path / "ckpt") if m.step == recovery["toStep"]
    ]
    assert all(record.cursors for record in restored.shards), restored
    queued = QUEUED.findall((tmp_path / "logs" / "worker-0.log").read_text())
    assert queued, job.logs()
    brought_up = tuple(int(n) for n in queued[-1])  # the queue the recovery brought up
    assert brought_up == _queue_from(restored), (queued, restored)


# "shard queue at data epoch E: D of T shards done": the chief's queue after each bring-up
QUEUED = re.compile(r"shard queue at data epoch (\d+): (\d+) of (\d+) shards done")
TOOK_BACK = re.compile(
    r"took back shard (\d+:\d+) from worker-1 \(lease \d+\): it goes on from batch (\d+) of"
)


def _plan() -> ShardPlan:
    """How the runtime cuts the job's data (TRAINING's dataset) into shards."""
    training = config.parse(TRAINING)
    data = training.dataset
    dataset = builtin.build_dataset(
        name=data.name, module=data.module, kwargs=data.kwargs, seed=training.seed
    )
    return ShardPlan.of(dataset, batch_size=training.batchSize, seed=training.seed)


def _queue_from(manifest: checkpoint.Manifest) -> tuple[int, ...]:
    """(data epoch, shards done, shards per epoch) of a queue rebuilt from the positions the ps
    restored from `manifest`: the lowest over the ps, in the newest data epoch among them."""
    plan = _plan()
    assert plan.shards is not None
    keys = {k for record in manifest.shards for k in record.cursors}
    positions = {k: min(r.cursors.get(k, 0) for r in manifest.shards) for k in keys}
    parsed = {tuple(map(int, k.split(":"))): v for k, v in positions.items()}
    epoch = max(e for e, _ in parsed)
    done = 0
    for (e, shard), applied in parsed.items():
        first, end = plan.span(shard)
        done += e == epoch and applied >= end - first
    if done == plan.shards:  # that epoch is over: the next one starts
        return epoch + 1, 0, plan.shards
    return epoch, done, plan.shards


def _ps_positions(job: harness.LocalJob) -> dict[str, int]:
    """Each data shard's position the ps tasks report in Status: the batches of it applied on
    every ps (the lowest over the ps)."""
    replies = []
    for address in job.spec["ps"]:
        with rpc.channel(address) as channel:
            call = rpc.PARAMETER_SERVER.callables(channel)["Status"]
            replies.append(call(ps_pb2.StatusRequest(), timeout=10))
    return psclient.merged_cursors(replies, how=min)


def test_a_killed_workers_shards_go_on_from_where_the_ps_tier_has_them(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric, undisturbed: dict[str, Any]
) -> None:
    job = _start(jobs, training=_training(tmp_path), log_dir=tmp_path / "logs")
    waiting.wait_for(lambda: _step(job, metric, "worker-1") >= 150, job, what="step 150")
    job.processes["worker-1"].send_signal(signal.SIGKILL)
    assert job.processes["worker-1"].wait(timeout=30) == -signal.SIGKILL
    # What the ps tier applied of each shard: with worker-1 dead its shards stand still, but
    # for a push of it already in a sync step, which closes with worker-0's.
    used = _ps_positions(job)
    assert used
    job.start_task("worker-1", metrics_port=job.metrics_ports["worker-1"])
    summary = _finish(job)
    assert summary["step"] == TRAINING["steps"]
    assert abs(summary["eval"]["accuracy"] - undisturbed["eval"]["accuracy"]) <= 0.01
    # The chief took worker-1's leases back, each shard from the batch after the last one
    # applied on every ps: not from the shard's start (batches used twice), not past it
    # (batches skipped), not "about where its last heartbeat said".
    took = TOOK_BACK.findall((tmp_path / "logs" / "worker-0.log").read_text())
    assert took, job.logs()
    for key, at in took:
        assert used.get(key, 0) <= int(at) <= used.get(key, 0) + 1, (key, at, used)


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


def test_a_paused_ps_that_comes_back_is_waited_for_not_rolled_back(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric, undisturbed: dict[str, Any]
) -> None:
    """A ps that stops answering (SIGSTOP: paused, overloaded, cut off) but comes back is the
    same process with its state whole: the chief waited 10 s for its Status, then rolled every
    ps back to the last checkpoint, or without one re-initialised the model from its seed."""
    training = {k: v for k, v in _training(tmp_path).items() if k != "checkpoint"}
    job = _start(jobs, training=training, log_dir=tmp_path / "logs", chief=True)
    waiting.wait_for(lambda: _step(job, metric, "chief-0") >= 100, job, what="step 100")
    ps = job.processes["ps-0"]
    ps.send_signal(signal.SIGSTOP)
    try:
        chief_log = tmp_path / "logs" / "chief-0.log"
        waiting.wait_for(
            lambda: "waiting for it to answer (no rollback)" in chief_log.read_text(),
            job,
            what="the chief to find ps-0 silent",
            timeout=90,
        )
    finally:
        ps.send_signal(signal.SIGCONT)
    summary = _finish(job)
    assert summary["step"] == TRAINING["steps"]
    assert summary["recoveries"] == [], job.logs()
    assert "rolling every ps back" not in chief_log.read_text()
    assert abs(summary["eval"]["accuracy"] - undisturbed["eval"]["accuracy"]) <= 0.02


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


def test_a_checkpoint_of_another_placement_is_cut_for_the_job_and_another_model_refused(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    first = _start(jobs, training=_training(tmp_path, steps=60), log_dir=tmp_path / "first")
    _finish(first)
    # 2 ps -> 3, shards of 1 KiB: every variable and its adam state put together, cut again
    second = _start(
        jobs,
        training=_training(tmp_path, steps=80, placement={"minShardBytes": 1024}),
        log_dir=tmp_path / "second",
        ps=3,
    )
    summary = _finish(second)
    assert summary["startedFrom"] == {"how": "restored", "step": 60}, second.logs()
    assert summary["step"] == 80
    assert summary["eval"]["accuracy"] > 0.5  # trained on from the first job's values
    said = (tmp_path / "second" / "worker-0.log").read_text()
    assert "cut the checkpoint of step 60 (2 ps, placement greedy, minShardBytes 262144)" in said
    assert not list((tmp_path / "ckpt").glob("reshard-*"))  # the cut parts are removed
    # another model (a hidden layer of 32, not 64): refused, naming the variable
    third = _start(
        jobs,
        training=_training(tmp_path, steps=100, model={"name": "mlp", "kwargs": {"hidden": [32]}}),
        log_dir=tmp_path / "third",
        ps=3,
    )
    # Only the chief (worker-0) ends: the ps stays up for a replacement chief, as it should,
    # and the `jobs` fixture stops it (waiting for every process here took 120 s).
    code = third.processes["worker-0"].wait(timeout=120)
    # final (InvalidTraining): a replacement chief would meet the same checkpoint; exit 1 was
    # retried to the backoff limit, which then named no cause
    assert code == 78, third.logs()
    said = (tmp_path / "third" / "worker-0.log").read_text()
    assert "variable \"['hidden_0']['bias']\" is float32[64], the job's model has" in said
    assert f"training.checkpoint.dir {str(tmp_path / 'ckpt')!r} holds a checkpoint" in said


def test_a_checkpoint_at_or_past_the_last_step_ends_the_job_with_no_checkpoint_error(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    """Rerun with fewer steps over a finished job's checkpoints: training is over at once
    (TensorFlow's MonitoredTrainingSession does the same), and the final checkpoint, refused
    by every ps past the last step, was reported as failed."""
    first = _start(jobs, training=_training(tmp_path, steps=60), log_dir=tmp_path / "first")
    _finish(first)
    second = _start(jobs, training=_training(tmp_path, steps=40), log_dir=tmp_path / "second")
    summary = _finish(second)
    assert summary["step"] == 60
    assert summary["startedFrom"] == {"how": "restored", "step": 60}
    assert summary["checkpointError"] is None, second.logs()
    assert summary["lastCheckpointStep"] == 60


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
