"""A preempted chief checkpoints the step the ps tier holds, with real processes.

Kueue preempts a job through the operator: the chief and the workers get SIGTERM first (the
chief exits 143, a worker drains and exits 0), the ps tasks only once the chief is gone, and the
job starts again later from its checkpoint. Nothing trained may be lost. No step here is timed
tightly (a loaded 2-core machine): every wait has a deadline, none is a bare sleep.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.train import checkpoint
from jaxps_runtime.wire import rpc
from tests.process import harness, test_signals, waiting

pytestmark = pytest.mark.process
Metric = Callable[[int, str], float | None]
TERM = 128 + signal.SIGTERM
EXIT_SECONDS = 60.0  # from the signal to the chief's exit: generous, the bound is the runtime's
PROMPT_SECONDS = 10.0  # test_signals' "promptly": a task typically exits a second after it
COMMITTED = re.compile(r"preempted \(SIGTERM\): checkpoint of step (\d+) committed in ([\d.]+) s")
# test_signals' job, without its periodic evaluations
TRAINING: dict[str, Any] = {k: v for k, v in test_signals.TRAINING.items() if k != "evalEverySteps"}


def _start(jobs: list[harness.LocalJob], log_dir: Path, **kwargs: Any) -> harness.LocalJob:
    """Starts a local job; the `jobs` fixture stops it after the test."""
    job = harness.LocalJob.start(log_dir=log_dir, **kwargs)
    jobs.append(job)
    return job


def _log(job: harness.LocalJob, task: str) -> str:
    path = job.log_dir / f"{task}.log"
    return path.read_text() if path.exists() else ""


def _terminate(job: harness.LocalJob, tasks: list[str]) -> dict[str, int | None]:
    """SIGTERM to every task of `tasks` at once, as the operator deletes their pods; their exit
    codes (None: still running after `EXIT_SECONDS`)."""
    for task in tasks:
        job.processes[task].send_signal(signal.SIGTERM)
    codes: dict[str, int | None] = {}
    for task in tasks:
        try:
            codes[task] = job.processes[task].wait(timeout=EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            codes[task] = None
    return codes


def _ps_step(address: str) -> int:
    with rpc.channel(address) as channel:
        status = rpc.PARAMETER_SERVER.callables(channel)["Status"]
        reply: ps_pb2.StatusReply = status(ps_pb2.StatusRequest(), timeout=10)
        return reply.step


def _global_step(job: harness.LocalJob, metric: Metric, task: str) -> float:
    return metric(job.metrics_ports[task], "jaxps_global_step") or 0.0


def test_a_preempted_chief_commits_the_step_the_ps_hold_and_the_job_resumes_from_it(
    jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric
) -> None:
    root = tmp_path / "ckpt"
    # With everySteps a periodic Save is always pending at the next multiple: a step the
    # stopped workers never reach, which the preempted chief must not wait for.
    training = {**TRAINING, "checkpoint": {"dir": str(root), "everySteps": 100_000}}
    job = _start(jobs, tmp_path / "logs", training=training, chief=True, ps=2, workers=2)
    waiting.wait_for(
        lambda: _global_step(job, metric, "chief-0") >= 30, job, timeout=180, what="step 30"
    )
    assert not checkpoint.committed(root)

    codes = _terminate(job, ["chief-0", "worker-0", "worker-1"])
    # The chief is preempted (143); a worker on SIGTERM drains: it gives its shards back to
    # the queue, leaves the job and exits 0.
    expected = {"chief-0": TERM, "worker-0": 0, "worker-1": 0}
    assert codes == expected, f"{codes}\n{job.logs()}"
    found = COMMITTED.search(_log(job, "chief-0"))
    assert found, job.logs()
    step, seconds = int(found[1]), float(found[2])
    print(f"preempted: checkpoint of step {step} committed in {seconds:.2f} s")
    assert [m.step for m in checkpoint.committed(root)] == [step]
    assert step >= 30
    # Nothing trained is lost: the checkpoint is the step the ps tier holds (sync: every ps
    # the same), which no stopped worker moves on.
    assert [_ps_step(a) for a in job.spec["ps"]] == [step, step]

    # The operator deletes the ps only now; the job is admitted again later, all of it new.
    assert set(_terminate(job, ["ps-0", "ps-1"]).values()) == {TERM}, job.logs()
    resumed = {**training, "steps": step + 20}
    again = _start(jobs, tmp_path / "logs-again", training=resumed, chief=True, ps=2, workers=2)
    codes = again.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{again.logs()}"
    summary = again.summary()
    assert summary["startedFrom"] == {"how": "restored", "step": step}
    assert summary["step"] == step + 20
    assert summary["lastCheckpointStep"] == step + 20
    assert f"restored every ps from the checkpoint of step {step}" in _log(again, "chief-0")


@dataclass(frozen=True)
class Case:
    """The signal a chief gets, whether its job has a checkpoint directory, what it logs."""

    signum: signal.Signals
    checkpoint_dir: bool
    said: str


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            Case(
                signal.SIGTERM,
                checkpoint_dir=False,
                said="preempted (SIGTERM): no checkpoint: training.checkpoint.dir is not set",
            ),
            id="sigterm-without-a-checkpoint-dir",
        ),
        pytest.param(
            Case(signal.SIGINT, checkpoint_dir=True, said="received SIGINT: stopping"),
            id="sigint",
        ),
    ],
)
def test_a_chief_with_nothing_to_checkpoint_on_its_signal_stops_promptly_and_writes_nothing(
    case: Case, jobs: list[harness.LocalJob], tmp_path: Path, metric: Metric
) -> None:
    root = tmp_path / "ckpt"
    # everySeconds: long enough that no periodic checkpoint happens before the signal.
    saving = {"dir": str(root), "everySeconds": 3600} if case.checkpoint_dir else {}
    training = {**TRAINING, "checkpoint": saving}
    job = _start(jobs, tmp_path / "logs", training=training, ps=1, workers=1)  # worker-0: chief
    waiting.wait_for(
        lambda: _global_step(job, metric, "worker-0") >= 10, job, timeout=180, what="step 10"
    )
    process = job.processes["worker-0"]
    sent = time.monotonic()
    process.send_signal(case.signum)
    code = process.wait(timeout=EXIT_SECONDS)
    seconds = time.monotonic() - sent
    print(f"worker-0: {case.signum.name} -> exit {code} in {seconds:.2f} s")
    log = _log(job, "worker-0")
    assert code == 128 + case.signum, f"{code}\n{job.logs()}"
    assert seconds < PROMPT_SECONDS, job.logs()
    assert case.said in log, job.logs()
    assert "checkpoint of step" not in log
    assert case.signum == signal.SIGTERM or "preempted" not in log
    assert not list(tmp_path.rglob("manifest-*")), job.logs()
    assert not list(tmp_path.rglob("step-*")), job.logs()
