"""A job's outcome is the truth (issue 31), with real `jaxps local` jobs.

Each test runs a whole TrainingJob through `jaxps local --json` (the operator's own reconcile
pass over local processes) and reads its final status: a user's code raising ends it
UserCodeError, a diverging one Diverged (or rolls back and goes on), a step that stands still
Stalled; and a task SIGKILLed (`--kill TASK@step=N`) in any phase, the last one included,
still ends Succeeded with the exported parameters on disk.

The faults come from a user model and dataset that misbehave on demand
(`outcome_user/faulty.py`, on the tasks' PYTHONPATH as a user's own module would be).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.ps import shardfile
from tests.process import harness
from tests.process.outcome_user import faulty

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[2]
USER = Path(faulty.__file__).resolve().parent
FAULTY_FILE = Path(faulty.__file__).resolve()
RUN_TIMEOUT = 200  # seconds for one `jaxps local` (below pytest's 300); each ends far sooner


@dataclass(frozen=True)
class Run:
    """One finished `jaxps local`: its exit code, final status and work directory."""

    code: int
    status: dict[str, Any]
    workdir: Path
    seconds: float  # wall time of the whole `jaxps local`, process starts included
    stderr: str

    def log(self, task: str) -> str:
        """Every start of the task's pod, in one file (a replaced pod appends)."""
        [path] = self.workdir.glob(f"*-{task}.log")
        return path.read_text(errors="replace")

    def logs(self) -> str:
        """What a failed assertion shows: the progress output and each task's log tail."""
        tails = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.workdir.glob("*.log"))
        )
        return f"status: {json.dumps(self.status, indent=1)}\n{self.stderr[-3000:]}\n{tails}"

    def condition(self, kind: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = [
            c for c in self.status.get("conditions", []) if c["type"] == kind
        ]
        [condition] = found
        return condition

    def events(self, reason: str) -> list[str]:
        lines = (self.workdir / "events.jsonl").read_text().splitlines()
        return [e["message"] for e in map(json.loads, lines) if e["reason"] == reason]

    def summary(self, chief: str) -> dict[str, Any]:
        """The chief's last JSON summary (its last start's), from its log."""
        done = [
            line for line in self.log(chief).splitlines() if line.startswith('{"event": "done"')
        ]
        assert done, self.logs()
        summary: dict[str, Any] = json.loads(done[-1])
        return summary

    def job_seconds(self) -> float:
        """From the job's start to its end, as its status says (whole seconds)."""
        start, end = (
            datetime.fromisoformat(self.status[k].replace("Z", "+00:00"))
            for k in ("startTime", "completionTime")
        )
        return (end - start).total_seconds()


def jaxps_local(tmp_path: Path, manifest: dict[str, Any] | str, *kills: str) -> Run:
    """Runs the manifest (a dict, or YAML text as a user writes it) to its end."""
    path = tmp_path / "job.yaml"
    path.write_text(manifest if isinstance(manifest, str) else yaml.safe_dump(manifest))
    workdir = tmp_path / "work"
    argv = [sys.executable, "-m", "jaxps_operator", "local", str(path), "--json"]
    argv += ["--workdir", str(workdir)]
    argv += [arg for kill in kills for arg in ("--kill", kill)]
    started = time.monotonic()
    with subprocess.Popen(
        argv,
        env=harness.runtime_env(
            {"PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(USER)])}
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as local:
        try:
            stdout, stderr = local.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            local.terminate()  # SIGTERM: `jaxps local` stops every task it started
            stdout, stderr = local.communicate(timeout=60)
            hung = Run(-1, {}, workdir, time.monotonic() - started, stderr)
            pytest.fail(f"jaxps local did not end within {RUN_TIMEOUT} s\n{hung.logs()}")
    seconds = time.monotonic() - started
    status = json.loads(stdout) if stdout.strip().startswith("{") else {}
    return Run(local.returncode, status, workdir, seconds, stderr)


def faulty_job(
    name: str,
    *,
    model: dict[str, Any] | None = None,
    dataset: dict[str, Any] | None = None,
    chief: bool = False,
    ps: int = 1,
    env: dict[str, dict[str, str]] | None = None,
    **training: Any,
) -> dict[str, Any]:
    """A small job on the faulty model and dataset: sync, 40 steps of 16 examples; `model` and
    `dataset` are their kwargs, `training` overrides spec.training, `env` a role's variables."""
    replicas: dict[str, Any] = {"ps": {"replicas": ps}, "worker": {"replicas": 2}}
    if chief:
        replicas["chief"] = {"replicas": 1}
    for role, variables in (env or {}).items():
        replicas[role]["template"] = {
            "spec": {
                "containers": [
                    {
                        "name": "jaxps",
                        "env": [{"name": k, "value": v} for k, v in variables.items()],
                    }
                ]
            }
        }
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": replicas,
            "training": {
                "model": {"name": "faulty", "module": "faulty:make_model", "kwargs": model or {}},
                "dataset": {"module": "faulty:make_dataset", "kwargs": dataset or {}},
                "mode": "sync",
                "steps": 40,
                "batchSize": 16,
                "optimizer": {"name": "sgd", "kwargs": {"learning_rate": 0.1}},
                "heartbeatSeconds": 0.25,
                "logEverySeconds": 1,
                **training,
            },
        },
    }


def _plan() -> ShardPlan:
    """How the runtime cuts `faulty_job`'s data: its shards of batches."""
    return ShardPlan.of(faulty.make_dataset(), batch_size=16, seed=0)


def _failed(run: Run, reason: str) -> str:
    """The Failed condition's message, once the job failed with `reason` (exit 1)."""
    assert run.code == 1, run.logs()
    assert run.status["state"] == "Failed", run.logs()
    failed = run.condition("Failed")
    assert failed["reason"] == reason, run.logs()
    message: str = failed["message"]
    return message


# --- UserCodeError ----------------------------------------------------------------------------


def test_a_dataset_raising_on_a_worker_fails_the_job_naming_the_users_file_and_line(
    tmp_path: Path,
) -> None:
    run = jaxps_local(tmp_path, faulty_job("raising-data", dataset={"worker": 1, "raiseAt": 3}))
    message = _failed(run, "UserCodeError")
    assert message.startswith("worker 1 (pod raising-data-worker-1) failed in the user's code"), (
        message
    )
    assert "(exit code 79)" in message
    # The runtime reads a dataset of rows through `examples` (the shard queue's batches); it
    # names the dataset's read as the dataset protocol's call.
    assert (
        "the dataset's train_batch raised LookupError: faulty dataset: no batch at read 3 of "
        "worker 1" in message
    ), message
    assert f"{FAULTY_FILE}:{faulty.RAISES_LINE} in examples" in message, message
    assert run.status["restarts"] == 0, run.logs()  # never retried


def test_a_model_whose_evaluate_raises_on_the_chief_fails_the_job_at_once(tmp_path: Path) -> None:
    # The workers drain at the last step and wait for the chief's word for as long as
    # startupTimeoutSeconds; the job must end on the chief's exit 79, not when they give up.
    wait = 300
    run = jaxps_local(
        tmp_path,
        faulty_job(
            "raising-eval", model={"evaluateRaises": True}, chief=True, startupTimeoutSeconds=wait
        ),
    )
    message = _failed(run, "UserCodeError")
    assert message.startswith("chief 0 (pod raising-eval-chief-0) failed in the user's code"), (
        message
    )
    assert "the model's evaluate raised ArithmeticError: faulty evaluate" in message
    assert f"{FAULTY_FILE}:{faulty.EVALUATE_RAISES_LINE} in evaluate" in message, message
    assert run.status["restarts"] == 0, run.logs()
    assert "restarts" not in run.status["replicaStatuses"]["chief"]  # 0: left out
    assert run.job_seconds() < wait / 2, run.logs()
    for worker in ("worker-0", "worker-1"):
        assert "the chief has not answered" not in run.log(worker), run.logs()


# --- Diverged ---------------------------------------------------------------------------------

# The manifest as a user writes it: YAML 1.1 (PyYAML) reads `1.0e+12` as a number, `1e12` as a
# string.
DIVERGING = """\
apiVersion: jaxps.dev/v1alpha1
kind: TrainingJob
metadata: {name: diverging}
spec:
  replicaSpecs:
    ps: {replicas: 1}
    worker: {replicas: 2}
  training:
    model: {name: mlp}
    dataset: {name: digits}
    mode: sync
    steps: 60
    batchSize: 16
    optimizer: {name: sgd, kwargs: {learning_rate: 1.0e+12}}
    logEverySeconds: 1
"""


def test_sgd_with_a_learning_rate_of_1e12_fails_diverged_within_60_seconds(
    tmp_path: Path,
) -> None:
    run = jaxps_local(tmp_path, DIVERGING)
    message = _failed(run, "Diverged")
    print(f"Diverged after {run.job_seconds():.0f} s of job, {run.seconds:.1f} s of jaxps local")
    assert run.job_seconds() < 60, run.logs()
    # "worker 1 (pod diverging-worker-1) found the training diverged (exit code 80): worker-1:
    # the loss is nan at global step 3 (batch 3 of its data shard); lower the learning rate..."
    role, index = message.split(" ", 2)[:2]
    assert role == "worker", message
    assert index in ("0", "1"), message
    assert f"(exit code 80): worker-{index}: " in message, message
    assert " at global step " in message, message
    assert "lower the learning rate" in message, message
    assert run.status["restarts"] == 0, run.logs()


def test_rollbacks_on_divergence_end_diverged_once_max_rollbacks_are_used_up(
    tmp_path: Path,
) -> None:
    job = faulty_job(
        "rolling",
        onDivergence="rollback",
        maxRollbacks=2,
        checkpoint={"dir": "ckpt", "everySteps": 10},
        optimizer={"name": "sgd", "kwargs": {"learning_rate": 1.0e12}},
    )
    run = jaxps_local(tmp_path, job)
    message = _failed(run, "Diverged")
    assert "and training.maxRollbacks (2) rollbacks are used up" in message, message
    assert " diverged at global step " in message, message
    chief = run.log("worker-0")
    assert "rollback 1 of at most 2, skipping that batch" in chief, run.logs()
    assert "rollback 2 of at most 2, skipping that batch" in chief, run.logs()
    assert run.status["restarts"] == 0, run.logs()


def test_one_bad_batch_is_rolled_back_and_skipped_and_the_job_succeeds(tmp_path: Path) -> None:
    job = faulty_job(
        "one-nan",
        dataset={"worker": 1, "nanAt": 15},
        onDivergence="rollback",
        checkpoint={"dir": "ckpt", "everySteps": 10},
        exportPath="export.npz",
    )
    run = jaxps_local(tmp_path, job)
    assert run.code == 0, run.logs()
    assert run.status["state"] == "Succeeded", run.logs()
    chief = run.log("worker-0")
    assert chief.count("skipping that batch") == 1, run.logs()
    assert "worker-1 diverged at global step" in chief, run.logs()
    assert "rollback 1 of at most 3" in chief, run.logs()
    [recovery] = run.summary("worker-0")["recoveries"]
    assert recovery["reason"].startswith("worker-1 diverged at global step"), recovery
    assert "the loss is nan" in run.log("worker-1"), run.logs()
    _assert_finite_export(run)


# --- Stalled ----------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoints", [False, True], ids=["", "with-a-checkpoint-pending"])
def test_a_worker_whose_batch_never_comes_stalls_the_job_naming_what_the_others_wait_for(
    tmp_path: Path, checkpoints: bool
) -> None:
    # The step stands at 5: worker-1's read 5 (its batch of step 5) never comes, and sync
    # waits for its gradient.
    # 10 s, not less: the clock runs from the chief's first look at the ps, and a worker still
    # starting (compiling its step on a loaded machine) must not count as a stall.
    # With checkpoints every 10 steps a Save of step 10 is always pending on the ps: it waits
    # for training, and does not hold the stall's clock (only a ps writing one does).
    timeout = 10
    extra: dict[str, Any] = {"checkpoint": {"dir": "ckpt", "everySteps": 10}} if checkpoints else {}
    job = faulty_job(
        "stalling", dataset={"worker": 1, "blockAt": 5}, progressTimeoutSeconds=timeout, **extra
    )
    run = jaxps_local(tmp_path, job)
    message = _failed(run, "Stalled")
    assert message.startswith("worker 0 (pod stalling-worker-0) found the training stalled"), (
        message
    )
    stands = re.search(rf"the global step has not moved from (\d+) for {timeout} s", message)
    assert stands, message
    step = int(stands[1])
    assert step == 5, message  # one step a read: its read 5 is its batch of step 5
    assert f"worker-0 waits for the other workers' gradients of step {step} (sync Update)" in (
        message
    )
    # Its read 5 is the sixth batch of the first shard the chief's queue leased it.
    waits = re.search(r"worker-1 waits for batch (\d+) of data epoch 0 from the dataset", message)
    assert waits, message
    assert int(waits[1]) % _plan().shard_batches == 5, message
    assert run.status["restarts"] == 0, run.logs()


# --- Succeeded ---------------------------------------------------------------------------------


def test_once_the_outcome_is_recorded_every_drained_worker_hears_it_and_ends_on_its_own(
    tmp_path: Path,
) -> None:
    # Drained workers wait for the chief's word, which only a heartbeat's reply carries. With
    # heartbeats 2 s apart, a chief that exits right after recording the outcome leaves them
    # waiting until the control plane deletes them (30 s after the job succeeded: SIGTERM).
    job = faulty_job("heard", chief=True, heartbeatSeconds=2, exportPath="export.npz")
    run = jaxps_local(tmp_path, job)
    assert run.code == 0, run.logs()
    assert run.status["state"] == "Succeeded", run.logs()
    _assert_finite_export(run)
    for worker in ("worker-0", "worker-1"):
        log = run.log(worker)
        assert f"{worker}: the chief says training is over" in log, run.logs()
        assert "received SIGTERM" not in log, run.logs()  # it ended on its own
    assert not run.events("PodsDeleted"), run.logs()  # nothing was left running to delete


# --- the kill matrix --------------------------------------------------------------------------

STEPS, EVERY = 60, 20
# Where the chief's global step is when `--kill` fires (it fires on the first pass of the local
# loop, every ~0.25 s, that reads the chief at or past that step). The batches take 50 ms each
# so that the passes land inside each phase: about 20 steps per second.
PHASES = {
    "at-start": 1,
    "mid-training": 30,
    # A ps writes every checkpoint for 5 s (the save failpoint): the one of step 20 is still
    # being written when the kill comes.
    "during-a-checkpoint": EVERY,
    # At the last step the chief finishes: it waits for every worker to say it is done, reads
    # the parameters, writes the final checkpoint, evaluates, exports and records the outcome.
    # Worker-1 reads one more batch before it sees the last step (and says done), and that
    # batch takes 5 s: the chief is still waiting for it when the kill comes, before its read.
    # (The steps after the read take milliseconds here, the export alone about one: no pass of
    # the loop can be made to land inside one of them through --kill.)
    "while-the-chief-finishes": STEPS,
}
SLOW_SECONDS = 5


def _matrix_job(phase: str) -> dict[str, Any]:
    slow_last_batch = {"worker": 1, "slowAt": STEPS, "slowSeconds": SLOW_SECONDS}
    return faulty_job(
        "killed",
        dataset={
            "batchSeconds": 0.05,
            **(slow_last_batch if phase == "while-the-chief-finishes" else {}),
        },
        chief=True,
        ps=2,
        env={"ps": {shardfile.FAILPOINT_SAVE_SLEEP: str(SLOW_SECONDS)}}
        if phase == "during-a-checkpoint"
        else None,
        steps=STEPS,
        checkpoint={"dir": "ckpt", "everySteps": EVERY},
        workerTimeoutSeconds=10,
        exportPath="export.npz",
    )


def _assert_finite_export(run: Run) -> dict[str, np.ndarray]:
    path = run.workdir / "export.npz"
    assert path.is_file(), run.logs()
    with np.load(path) as exported:
        values = {name: exported[name] for name in exported.files}
    assert sorted(values) == ["['b']", "['w']"], values  # by leaf path, as the runtime names them
    assert all(np.isfinite(v).all() for v in values.values()), values
    return values


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("task", ["ps-0", "worker-1", "chief-0"])
def test_a_task_killed_in_any_phase_still_succeeds_with_the_export_written(
    tmp_path: Path, task: str, phase: str
) -> None:
    run = jaxps_local(tmp_path, _matrix_job(phase), f"{task}@step={PHASES[phase]}")
    print(f"{task} killed {phase}: {run.seconds:.1f} s")
    assert run.code == 0, run.logs()
    assert run.status["state"] == "Succeeded", run.logs()
    # The kill did come while the task ran, and before the outcome was recorded: its pod was
    # replaced (a pod that ends once the chief's summary is in is never replaced). A kill that
    # never came would prove nothing.
    assert run.log(task).count(f" starting killed-{task}\n") == 2, run.logs()
    assert run.status["restarts"] == 1, run.logs()
    assert run.status["progress"]["step"] == STEPS, run.logs()
    _assert_finite_export(run)
    summary = run.summary("chief-0")
    assert summary["step"] == STEPS
    assert summary["eval"]["loss"] < 0.1, summary  # trained, not just written
    if (task, phase) == ("ps-0", "during-a-checkpoint"):
        assert f"checkpoint of step {EVERY} not committed" in run.log("chief-0"), run.logs()
    if (task, phase) == ("ps-0", "while-the-chief-finishes"):
        # lost before the outcome was recorded: rolled back, trained again, finished again
        assert "while finishing: recovering, then finishing again" in run.log("chief-0"), run.logs()
        [recovery] = summary["recoveries"]
        assert recovery["fromStep"] == STEPS, recovery
        assert recovery["toStep"] < STEPS, recovery
    if (task, phase) == ("chief-0", "while-the-chief-finishes"):
        # the replacement found every ps still at the last step, and finished again
        assert summary["startedFrom"] == {"how": "adopted", "step": STEPS}, summary
    # worker-0, never killed, was told by the chief (or its replacement) that the job is over
    assert "worker-0: the chief says training is over" in run.log("worker-0"), run.logs()


# --- a user's own loop that goes astray -------------------------------------------------------


def _digits_job(name: str, **training: Any) -> dict[str, Any]:
    """1 ps and 2 workers training on digits, sync, 60 steps; `training` names the model or
    the program, and overrides the rest."""
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {"ps": {"replicas": 1}, "worker": {"replicas": 2}},
            "training": {
                "dataset": {"name": "digits"},
                "mode": "sync",
                "steps": 60,
                "batchSize": 16,
                "optimizer": {"name": "sgd", "kwargs": {"learning_rate": 0.1}},
                "heartbeatSeconds": 0.25,
                "logEverySeconds": 1,
                **training,
            },
        },
    }


def _program_job(name: str, program: str, **training: Any) -> dict[str, Any]:
    """`_digits_job` running `outcome_user/wayward.py`'s `program`."""
    return _digits_job(name, program=f"wayward:{program}", **training)


def test_a_program_calling_sys_exit_0_before_training_fails_the_job_as_users_code(
    tmp_path: Path,
) -> None:
    run = jaxps_local(tmp_path, _program_job("exits", "exits"))
    message = _failed(run, "UserCodeError")
    assert "training.program 'wayward:exits' raised SystemExit: 0" in message, message
    assert "wayward.py" in message, message
    assert run.status["restarts"] == 0, run.logs()


def test_a_program_ending_its_process_with_exit_0_fails_the_job_no_outcome(tmp_path: Path) -> None:
    """os._exit(0) raises nothing: worker 0 (the chief) ends with exit 0 and no summary, which
    was read as Succeeded with nothing trained."""
    run = jaxps_local(tmp_path, _program_job("vanishes", "vanishes"))
    message = _failed(run, "NoOutcome")
    assert message.startswith(
        "worker 0 (pod vanishes-worker-0) exited 0 without recording the job's outcome"
    ), message
    assert run.status["restarts"] == 0, run.logs()


def test_a_program_pushing_a_gradient_of_no_variable_fails_naming_it(tmp_path: Path) -> None:
    """`W` pushed for `w` was dropped without a word: the job trained nothing (its loss stayed
    ln 10) and was Succeeded."""
    run = jaxps_local(tmp_path, _program_job("misnames", "misnames"))
    message = _failed(run, "UserCodeError")
    assert "push: gradients for ['W'], which is not a variable of this session" in message, message
    assert "(its variables: ['b'], ['w'])" in message, message


def test_a_program_declaring_no_variables_fails_at_once_not_stalled(tmp_path: Path) -> None:
    run = jaxps_local(tmp_path, _program_job("nothing", "declares_nothing"))
    message = _failed(run, "UserCodeError")
    assert "program.session: no variables (an empty tree): nothing to train" in message, message


def test_tasks_declaring_different_variables_fail_at_once_naming_them(tmp_path: Path) -> None:
    """Worker 1 retried its Read without end (4678 log lines in 30 s), and the job failed
    Stalled after progressTimeoutSeconds without naming the cause."""
    run = jaxps_local(tmp_path, _program_job("differ", "declares_by_task"))
    message = _failed(run, "UserCodeError")
    assert "worker-1: its variables are not those the ps tier holds" in message, message
    assert "float32[65, 10]" in message, message
    assert "float32[64, 10]" in message, message
    assert run.seconds < 120, run.logs()


def test_a_program_leaving_its_session_early_fails_the_job_at_once_saying_so(
    tmp_path: Path,
) -> None:
    run = jaxps_local(tmp_path, _program_job("leaves", "leaves_early"))
    message = _failed(run, "UserCodeError")
    assert "training.program 'wayward:leaves_early' left its session at step" in message, message
    assert "before training ended (training.steps 60)" in message, message
    assert run.status["restarts"] == 0, run.logs()
    assert run.seconds < 120, run.logs()  # not restarted until the backoff limit


def test_a_program_stuck_in_its_own_code_on_worker_0_fails_stalled_and_ends(
    tmp_path: Path,
) -> None:
    job = _program_job("hangs", "hangs", progressTimeoutSeconds=10)
    worker = job["spec"]["replicaSpecs"]["worker"]
    grace = {"name": "JAXPS_LOOP_GRACE_SECONDS", "value": "3"}  # the loop's, after the outcome
    worker["template"] = {"spec": {"containers": [{"name": "jaxps", "env": [grace]}]}}
    run = jaxps_local(tmp_path, job)
    message = _failed(run, "Stalled")
    assert "the global step has not moved" in message, message
    assert "worker-0 waits for nothing of jaxps: it was last in its own step's code" in message
    assert "did not return within 3 s of the job's end" in run.log("worker-0"), run.logs()


@pytest.mark.parametrize("label", [-1, 10])
def test_labels_outside_the_models_classes_fail_the_job_as_invalid_training(
    tmp_path: Path, label: int
) -> None:
    """A negative label trained to accuracy 0 and Succeeded; one past the classes was NaN, and
    the job Diverged: both are the data's fault, said at once."""
    data = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 400).astype(np.int32)
    labels[::4] = label
    np.savez(data, x=rng.normal(size=(400, 64)).astype(np.float32), y=labels)
    job = _digits_job(
        "labels",
        model={"name": "mlp", "kwargs": {"hidden": [16]}},
        dataset={"name": "arrays", "kwargs": {"path": str(data)}},
    )
    run = jaxps_local(tmp_path, job)
    message = _failed(run, "InvalidTraining")
    assert f"a label {label}, but model mlp has 10 classes (labels 0..9)" in message, message
    assert "training.model.kwargs.classes" in message, message


def test_a_loss_that_only_grew_though_finite_fails_diverged_not_succeeded(tmp_path: Path) -> None:
    """sgd at 1e6: every value stays finite, the loss goes from about 2.3 to hundreds of
    thousands and the model predicts at chance; it was reported Succeeded."""
    job = _digits_job(
        "grew",
        model={"name": "mlp", "kwargs": {"hidden": [16]}},
        optimizer={"name": "sgd", "kwargs": {"learning_rate": 1e6}},
        steps=50,
    )
    run = jaxps_local(tmp_path, job)
    message = _failed(run, "Diverged")
    assert re.search(r"the workers' mean loss grew from 2\.\d+ \(step 0\) to ", message), message
    assert "though every value stayed finite" in message, message


def test_a_model_whose_init_raises_fails_the_job_naming_init_not_the_dataset(
    tmp_path: Path,
) -> None:
    run = jaxps_local(tmp_path, faulty_job("raising-init", model={"initRaises": True}))
    message = _failed(run, "UserCodeError")
    assert "the model's init raised RuntimeError: faulty init: no parameters to give" in message
    assert f"{FAULTY_FILE}:{faulty.INIT_RAISES_LINE} in init" in message, message
    assert "cannot train on dataset" not in message, message


def test_a_loss_that_is_not_a_scalar_is_refused_at_start_naming_its_shape(tmp_path: Path) -> None:
    """jax.grad refused it at the first step, and the message named jaxps' own frame."""
    run = jaxps_local(tmp_path, faulty_job("vector-loss", model={"vectorLoss": True}))
    message = _failed(run, "InvalidTraining")
    assert "its loss on a batch of dataset" in message, message
    assert "is float32[16]; it must be a scalar (one float)" in message, message
