"""SIGTERM and SIGINT stop every role cleanly and promptly, with real processes.

In a pod the runtime is PID 1, which ignores a signal it has no handler for: a task without
one would keep its pod Terminating for the whole grace period. "Promptly" here is a deadline a
loaded 2-core machine keeps (a task typically exits about a second after the signal).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.ps import shardfile
from jaxps_runtime.train import checkpoint
from jaxps_runtime.wire import rpc
from tests.process import harness, waiting

pytestmark = pytest.mark.process
Metric = Callable[[int, str], float | None]
DEADLINE = 10.0  # seconds from the signal to the exit
# A worker told to stop (SIGTERM: the job is scaled down, suspended or preempted) drains: its
# last push is in, it gives its leases back to the chief's shard queue and exits 0. The chief
# (worker 0 of a job without one) and a ps exit 143; SIGINT is 130 for every role.
DRAINED = 0
TRAINING: dict[str, Any] = {
    "model": {"name": "mlp"},
    "mode": "sync",
    "steps": 1_000_000,  # trains until a test stops it
    "batchSize": 32,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    "evalEverySteps": 20,
    "heartbeatSeconds": 0.25,
    "workerTimeoutSeconds": 60,  # a stopped worker is not dropped while a test runs
    "logEverySeconds": 2,
}


@dataclass(frozen=True)
class Case:
    """A job shape, the task to signal, the signal and the exit code it should end with."""

    task: str
    signal: signal.Signals = signal.SIGTERM
    code: int = 128 + signal.SIGTERM
    job: dict[str, Any] = field(default_factory=dict)


def _start(jobs: list[harness.LocalJob], tmp_path: Path, **kwargs: Any) -> harness.LocalJob:
    """Starts a local job; the `jobs` fixture stops it after the test."""
    options: dict[str, Any] = {"ps": 1, "workers": 2, "training": TRAINING, **kwargs}
    job = harness.LocalJob.start(log_dir=tmp_path / "logs", **options)
    jobs.append(job)
    return job


def _wait_for(
    condition: Callable[[], bool], job: harness.LocalJob, *, timeout: float = 180, what: str
) -> None:
    waiting.wait_for(condition, job, timeout=timeout, what=what)


def _chief(job: harness.LocalJob) -> str:
    return "chief-0" if "chief" in job.spec else "worker-0"


def _log(job: harness.LocalJob, task: str) -> str:
    path = job.log_dir / f"{task}.log"
    return path.read_text() if path.exists() else ""


def _signal(job: harness.LocalJob, task: str, signum: signal.Signals) -> tuple[int | None, float]:
    """Sends `signum` to the task; its exit code (None: still running at the deadline) and the
    seconds it took to exit."""
    process = job.processes[task]
    sent = time.monotonic()
    process.send_signal(signum)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=DEADLINE)
    return process.poll(), time.monotonic() - sent


def _assert_stopped(job: harness.LocalJob, case: Case, code: int | None, seconds: float) -> None:
    print(f"{case.task}: {case.signal.name} -> exit {code} in {seconds:.2f} s")
    assert code == case.code, f"{case.task} exited {code} after {seconds:.1f} s\n{job.logs()}"
    assert f"received {case.signal.name}: stopping" in _log(job, case.task), job.logs()


def _ps_status(address: str) -> ps_pb2.StatusReply:
    with rpc.channel(address) as channel:
        status = rpc.PARAMETER_SERVER.callables(channel)["Status"]
        reply: ps_pb2.StatusReply = status(ps_pb2.StatusRequest(), timeout=10)
        return reply


def _assert_ps_serving(job: harness.LocalJob) -> None:
    """Every ps is still up, SERVING and READY: what a replacement chief adopts."""
    for i, address in enumerate(job.spec["ps"]):
        process = job.processes[f"ps-{i}"]
        assert process.poll() is None, f"ps-{i} exited {process.returncode}\n{job.logs()}"
        harness.wait_serving(address, timeout=30, process=process)
        assert _ps_status(address).state == ps_pb2.READY
        assert "shutdown requested" not in _log(job, f"ps-{i}")


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case("worker-1", code=DRAINED), id="worker"),
        pytest.param(Case("worker-1", signal.SIGINT, 128 + signal.SIGINT), id="worker-sigint"),
        pytest.param(Case("chief-0", job={"chief": True, "ps": 2, "workers": 1}), id="chief"),
        pytest.param(Case("worker-0"), id="worker-0-as-chief"),
        pytest.param(Case("evaluator-0", job={"evaluator": True, "workers": 1}), id="evaluator"),
    ],
)
def test_a_training_task_stops_promptly_with_its_exit_code_on_a_signal(
    case: Case, jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric
) -> None:
    job = _start(jobs, tmp_path, **case.job)
    chief = _chief(job)
    _wait_for(
        lambda: (metric(job.metrics_ports[chief], "jaxps_global_step") or 0) >= 20,
        job,
        what="training",
    )
    if case.task.startswith("evaluator"):
        _wait_for(
            lambda: (metric(job.metrics_ports[case.task], "jaxps_global_step") or 0) > 0,
            job,
            what="a first evaluation",
        )
    code, seconds = _signal(job, case.task, case.signal)
    _assert_stopped(job, case, code, seconds)
    if case.task == chief:
        _assert_ps_serving(job)


def test_a_ps_exits_143_and_the_workers_waiting_for_it_to_come_back_stop_promptly(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric
) -> None:
    job = _start(jobs, tmp_path, ps=2)
    _wait_for(
        lambda: (metric(job.metrics_ports["worker-0"], "jaxps_global_step") or 0) >= 20,
        job,
        what="training",
    )
    ps = Case("ps-0")  # 143: stopped mid-job, not done (only Shutdown ends a ps with 0)
    _assert_stopped(job, ps, *_signal(job, ps.task, ps.signal))
    # The chief noticed; worker-1 is blocked either waiting for the ps tier or at ps-1's sync
    # barrier (worker-0 no longer pushes), which of the two depends on timing: both must stop.
    _wait_for(
        lambda: "rolling every ps back" in _log(job, "worker-0"),
        job,
        what="the chief waiting for ps-0",
    )
    # a worker (drains), then the chief (worker 0) and its worker
    for case in (Case("worker-1", code=DRAINED), Case("worker-0")):
        _assert_stopped(job, case, *_signal(job, case.task, case.signal))
    assert job.processes["ps-1"].poll() is None
    assert "shutdown requested" not in _log(job, "ps-1")


def test_a_chief_waiting_for_a_ps_that_never_comes_stops_promptly(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    job = _start(jobs, tmp_path, workers=1, order=["worker-0"])
    _wait_for(lambda: "waiting for 1 ps" in _log(job, "worker-0"), job, what="the ps wait")
    case = Case("worker-0")
    _assert_stopped(job, case, *_signal(job, case.task, case.signal))


def test_a_worker_waiting_for_a_chief_that_never_comes_stops_promptly(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    job = _start(jobs, tmp_path, workers=1, chief=True, order=["worker-0"])
    _wait_for(
        lambda: "waiting for the chief at" in _log(job, "worker-0"), job, what="the chief wait"
    )
    case = Case("worker-0", code=DRAINED)  # a worker (the job has a chief): nothing to give back
    _assert_stopped(job, case, *_signal(job, case.task, case.signal))


@pytest.fixture
def paused() -> Iterator[list[harness.LocalJob]]:
    """Jobs with a SIGSTOPped task: continued before the `jobs` fixture stops them."""
    started: list[harness.LocalJob] = []
    yield started
    for job in started:
        for process in job.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)


def test_a_worker_waiting_at_a_sync_barrier_stops_promptly(
    jobs: list[harness.LocalJob], paused: list[harness.LocalJob], tmp_path: Path, metric: Metric
) -> None:
    job = _start(jobs, tmp_path, chief=True)
    paused.append(job)
    _wait_for(
        lambda: (metric(job.metrics_ports["chief-0"], "jaxps_global_step") or 0) >= 20,
        job,
        what="training",
    )
    job.processes["worker-1"].send_signal(signal.SIGSTOP)  # its gradient never comes
    address = job.spec["ps"][0]

    def stuck() -> bool:
        before = _ps_status(address)
        time.sleep(0.5)
        after = _ps_status(address)
        return after.awaiting == 1 and after.step == before.step

    _wait_for(stuck, job, what="worker-0 waiting for worker-1's gradient")
    case = Case("worker-0", code=DRAINED)  # a worker (the job has a chief)
    _assert_stopped(job, case, *_signal(job, case.task, case.signal))


def test_a_chief_stopped_while_a_checkpoint_is_written_commits_nothing(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    training = {**TRAINING, "checkpoint": {"dir": str(root), "everySteps": 50}}
    slow_saves = {"ps-0": {shardfile.FAILPOINT_SAVE_SLEEP: "3"}}
    job = _start(
        jobs, tmp_path, chief=True, ps=2, workers=1, training=training, task_env=slow_saves
    )
    partial = root / f"step-{50:09d}" / "ps-0.npz.tmp"
    _wait_for(partial.exists, job, what="ps-0 writing the checkpoint of step 50")
    # SIGINT: on SIGTERM a chief with a checkpoint dir commits one last checkpoint (preemption)
    case = Case("chief-0", signal.SIGINT, 128 + signal.SIGINT)
    _assert_stopped(job, case, *_signal(job, case.task, case.signal))
    _assert_ps_serving(job)
    _wait_for(partial.with_suffix("").exists, job, what="ps-0 finishing its file")
    assert not checkpoint.committed(root)  # every shard is there, but no manifest commits it
