"""`jaxps local`: the examples run as they are, recoveries are counted, failures end Failed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from jaxps_operator import builders, local, schema
from jaxps_runtime.config import cluster
from jaxps_runtime.train import checkpoint
from tests.process import harness

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def jaxps_local(
    manifest: Path,
    tmp_path: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxps_operator",
            "local",
            str(manifest),
            "--json",
            "--workdir",
            str(tmp_path / "work"),
            *extra,
        ],
        env=harness.runtime_env({"PYTHONPATH": str(ROOT / "operator"), **(env or {})}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=cwd,
    )
    status = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()}" for p in sorted((tmp_path / "work").glob("*.log"))
    )
    return done.returncode, status, f"{done.stderr}\n{logs}"


def alive_with_job_name(name: str) -> list[int]:
    """Processes still running with JAXPS_JOB_NAME=name in their environment, started under
    this pytest-xdist worker (every process a test starts inherits its PYTEST_XDIST_WORKER):
    a worker runs one test at a time, and the same example may run under another worker at
    once (a job named mnist of another test was taken for this one's leftover)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    mine = f"PYTEST_XDIST_WORKER={worker}".encode() if worker else None
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"JAXPS_JOB_NAME={name}".encode() in environ and (mine is None or mine in environ):
            found.append(int(entry.name))
    return found


def test_the_mnist_example_succeeds_with_95_percent(tmp_path: Path) -> None:
    code, status, logs = jaxps_local(EXAMPLES / "mnist.yaml", tmp_path)
    assert code == 0, logs
    assert status["state"] == "Succeeded"
    assert status["progress"]["eval"]["accuracy"] >= 0.95
    assert status["progress"]["step"] == 600
    assert status["progress"]["lastCheckpointStep"] == 600
    reasons = {c["type"]: c["reason"] for c in status["conditions"]}
    assert reasons["Succeeded"] == "JobSucceeded"
    assert not alive_with_job_name("mnist")
    # TensorBoard's event files, in the work directory by default, and the loss curve at the end
    board = tmp_path / "work" / "tensorboard"
    assert f"TensorBoard: tensorboard --logdir {board}" in logs
    assert list((board / "train").glob("events.out.tfevents.*")), logs
    assert "\nloss:\n" in logs
    assert "└" + "─" * 60 in logs


def test_killing_ps_0_mid_training_still_succeeds_and_counts_the_restart(tmp_path: Path) -> None:
    code, status, logs = jaxps_local(EXAMPLES / "mnist.yaml", tmp_path, "--kill", "ps-0@step=250")
    assert code == 0, logs
    assert status["state"] == "Succeeded"
    assert status["restarts"] == 1
    assert status["replicaStatuses"]["ps"]["restarts"] == 1
    assert status["progress"]["eval"]["accuracy"] >= 0.95
    assert "rolling every ps back" in logs
    # the replacement was the job's standby, a ps loaded ahead; none is left running
    [ps0] = (tmp_path / "work").glob("*-ps-0.log")
    assert "started from the job's standby" in ps0.read_text(), logs
    assert not alive_with_job_name("mnist")


def test_a_worker_that_exits_1_under_never_fails_the_job_and_nothing_stays(
    tmp_path: Path,
) -> None:
    name = f"fails-{uuid.uuid4().hex[:6]}"
    manifest = yaml.safe_load((EXAMPLES / "mnist.yaml").read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["replicaSpecs"]["worker"]["restartPolicy"] = "Never"
    manifest["spec"]["replicaSpecs"]["worker"]["template"] = {
        "spec": {
            "containers": [
                {
                    "name": "jaxps",
                    "command": ["python", "-c", "import time, sys; time.sleep(3); sys.exit(1)"],
                }
            ]
        }
    }
    path = tmp_path / "fails.yaml"
    path.write_text(yaml.safe_dump(manifest))
    code, status, logs = jaxps_local(path, tmp_path)
    assert code == 1, logs
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ReplicaFailed"
    assert "(pod " + name + "-worker-" in failed["message"]
    assert "failed with exit code 1; its restartPolicy is Never" in failed["message"]
    assert failed["message"].startswith("worker ")
    assert status["state"] == "Failed"
    assert not alive_with_job_name(name)


@pytest.mark.parametrize("example", ["async.yaml", "embedding.yaml", "user-model.yaml"])
def test_every_other_example_runs_as_it_is(tmp_path: Path, example: str) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(EXAMPLES / "user_model")])}
    code, status, logs = jaxps_local(EXAMPLES / example, tmp_path, env=env)
    assert code == 0, logs
    assert status["state"] == "Succeeded"
    assert status["progress"]["eval"]


def test_an_invalid_manifest_exits_2_naming_the_field(tmp_path: Path) -> None:
    manifest = yaml.safe_load((EXAMPLES / "mnist.yaml").read_text())
    manifest["spec"]["replicaSpecs"]["chief"] = {"replicas": 2}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest))
    code, status, logs = jaxps_local(path, tmp_path)
    assert code == 2
    assert status == {}
    assert "spec.replicaSpecs: Invalid value" in logs
    assert "at most one chief" in logs


def test_a_local_process_gets_the_pods_environment_as_the_builder_made_it(tmp_path: Path) -> None:
    manifest = yaml.safe_load((EXAMPLES / "mnist.yaml").read_text())
    manifest["spec"]["replicaSpecs"]["worker"]["template"] = {
        "spec": {
            "containers": [
                {
                    "name": "jaxps",
                    "env": [{"name": "JAXPS_LOG_LEVEL", "value": "DEBUG"}],
                    "command": [
                        "python",
                        "-c",
                        "import json, os, sys; json.dump(dict(os.environ), sys.stdout)",
                    ],
                }
            ]
        }
    }
    job = schema.validate(manifest)
    local_cluster = local.LocalCluster(job=local.local_job(job, tmp_path), workdir=tmp_path)
    try:
        network = local_cluster.network(local_cluster.job)
        ports = [int(a.rsplit(":", 1)[1]) for row in network.addresses.values() for a in row]
        ports += list(network.metrics_ports.values())
        assert len(set(ports)) == len(ports) == 8  # gRPC and metrics, never shared
        pod = builders.pod(local_cluster.job, "worker", 1, network=network)
        assert local_cluster.create(local_cluster.job, pod)
        proc = local_cluster.processes["mnist-worker-1"]
        assert proc.popen.wait(timeout=60) == 0
        text = (tmp_path / "mnist-worker-1.log").read_text()
        environ = json.loads(text[text.index("{") :])
        for variable in pod["spec"]["containers"][0]["env"]:
            if variable["name"] == "JAXPS_TERMINATION_LOG":
                continue  # the local backend's own file, below
            assert environ[variable["name"]] == variable.get("value", ""), variable["name"]
        assert environ["JAXPS_LOG_LEVEL"] == "DEBUG"
        assert environ["JAXPS_TERMINATION_LOG"] == str(tmp_path / "mnist-worker-1.termination-log")
        state = local_cluster.children(local_cluster.job).pods[0]
        assert (state.phase, state.exit_code) == ("Succeeded", 0)
    finally:
        local_cluster.stop_all()


@contextlib.contextmanager
def _running(manifest: dict[str, Any], tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """`jaxps local` of `manifest` in the background, its work directory tmp_path/work;
    killed if it still runs when the block ends."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxps_operator", "local", str(path), "--workdir", str(work)],
        env=harness.runtime_env({"PYTHONPATH": str(ROOT / "operator")}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _until(proc: subprocess.Popen[str], condition: Callable[[], bool], *, what: str) -> None:
    """Waits (180 s at most) until `condition`, failing with the run's words if it ends first."""
    deadline = time.monotonic() + 180
    while not condition():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_sigterm_to_jaxps_local_stops_the_ps_last_so_the_chiefs_checkpoint_commits(
    tmp_path: Path,
) -> None:
    """Every task got SIGTERM at once: the chief's preemption checkpoint then failed on ps that
    were shutting down ("ps-0 is shutting down"), and the steps since the last checkpoint were
    lost. The ps now stop once the others have ended."""
    manifest = yaml.safe_load((EXAMPLES / "mnist.yaml").read_text())
    manifest["metadata"]["name"] = f"term-{uuid.uuid4().hex[:8]}"
    training = manifest["spec"]["training"]
    training["steps"] = 1_000_000
    root = tmp_path / "ckpt"
    training["checkpoint"] = {"dir": str(root), "everySteps": 500_000}
    chief_log = tmp_path / "work" / f"{manifest['metadata']['name']}-worker-0.log"
    with _running(manifest, tmp_path) as proc:
        _until(
            proc,
            lambda: "step " in (chief_log.read_text() if chief_log.exists() else ""),
            what="the chief's first step",
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = chief_log.read_text()
    assert "preempted (SIGTERM): checkpoint of step" in said, said[-3000:]
    assert checkpoint.committed(root), said[-3000:]
    assert alive_with_job_name(manifest["metadata"]["name"]) == []


def _remove(tree: Path) -> None:
    """`rm -rf` until the tree is gone: tasks still writing their logs add files to a directory
    being emptied, and one pass then ends "Directory not empty" (as `rm -rf` itself would)."""
    deadline = time.monotonic() + 60
    while tree.exists():
        assert time.monotonic() < deadline, f"{tree} still there after 60 s of removing it"
        shutil.rmtree(tree, ignore_errors=True)


def test_a_work_directory_removed_mid_run_stops_every_task_saying_so(tmp_path: Path) -> None:
    """`rm -rf` of the work directory mid-run ended `jaxps local` with a FileNotFoundError
    traceback."""
    manifest = yaml.safe_load((EXAMPLES / "mnist.yaml").read_text())
    name = manifest["metadata"]["name"] = f"gone-{uuid.uuid4().hex[:8]}"
    manifest["spec"]["training"].update(steps=1_000_000)
    manifest["spec"]["training"].pop("checkpoint")
    work = tmp_path / "work"
    with _running(manifest, tmp_path) as proc:
        _until(proc, (work / f"{name}-worker-1.log").exists, what="a task to start")
        _remove(work)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert f"the work directory {work} was removed while the job ran" in err, err
    assert "Traceback" not in err, err
    assert alive_with_job_name(name) == []


def test_free_ports_are_distinct() -> None:
    ports = cluster.free_ports(64)
    assert len(set(ports)) == 64


def test_two_runs_of_one_manifest_started_together_keep_their_own_work_directories(
    tmp_path: Path,
) -> None:
    """No --workdir: each gets `.work/<name>-<time>` of its own (then -2), in the same second;
    and --json prints strict JSON (any parser takes it) with a separate chief's progress."""
    name = f"twice-{uuid.uuid4().hex[:6]}"
    manifest = {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {"chief": {"replicas": 1}, "ps": {"replicas": 1}, "worker": {}},
            "training": {
                "model": {"name": "mlp", "kwargs": {"hidden": [8]}},
                "dataset": {"name": "digits"},
                "steps": 30,
                "batchSize": 16,
            },
        },
    }
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump(manifest))
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxps_operator", "local", str(path), "--json"],
            env=harness.runtime_env({"PYTHONPATH": str(ROOT / "operator")}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err
        status = json.loads(out, parse_constant=lambda token: pytest.fail(f"{token} in JSON"))
        assert status["state"] == "Succeeded"
        assert status["progress"]["step"] == 30
    workdirs = sorted((tmp_path / ".work").iterdir())
    assert len(workdirs) == 2, outputs
    for workdir in workdirs:
        assert (workdir / local.JOB_FILE).is_file()
        assert json.loads((workdir / local.JOB_FILE).read_text())["status"]["state"] == "Succeeded"
    assert not alive_with_job_name(name)
