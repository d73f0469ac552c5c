"""A ps standby on its own: it becomes the ps it is told, and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxps_runtime.config import cluster
from jaxps_runtime.process import standby
from tests.process import harness

pytestmark = pytest.mark.process


def _standby(tmp_path: Path) -> standby.Standby:
    env = harness.runtime_env({"JAXPS_JOB_UID": "standby-job"})
    return standby.Standby(env, log=tmp_path / "standby.log")


def _tf_config(role: str) -> str:
    ports = cluster.free_ports(2)
    spec = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    return cluster.build_tf_config(cluster=spec, task_type=role, task_index=0)


def test_a_standby_becomes_the_ps_it_is_given_and_serves(tmp_path: Path) -> None:
    ready = _standby(tmp_path)
    env = {
        **ready.env,
        "TF_CONFIG": _tf_config("ps"),
        "JAXPS_METRICS_PORT": "0",
    }
    proc = ready.take(env, stdout=tmp_path / "ps-0.out", stderr=tmp_path / "ps-0.log")
    assert proc is ready.process
    try:
        address = json.loads(env["TF_CONFIG"])["cluster"]["ps"][0]
        harness.wait_serving(address, timeout=120, process=proc)
        assert "started from the job's standby" in (tmp_path / "ps-0.log").read_text()
    finally:
        harness.LocalPs([], [proc]).stop()
    assert proc.returncode == 143  # SIGTERM: a ps stopped mid-job


def test_a_task_that_differs_in_more_than_its_identity_is_not_given_to_it(
    tmp_path: Path,
) -> None:
    ready = _standby(tmp_path)
    try:
        env = {**ready.env, "TF_CONFIG": _tf_config("ps"), "XLA_FLAGS": "--xla_dump_to=/tmp"}
        # JAX read the standby's XLA_FLAGS as it loaded: this ps must start as a new process
        assert ready.take(env, stdout=tmp_path / "o", stderr=tmp_path / "e") is None
        assert ready.process.poll() is None  # still waiting for a ps that fits
    finally:
        ready.close()
    assert ready.process.returncode is not None


def test_a_standby_told_to_be_a_worker_refuses_with_exit_2(tmp_path: Path) -> None:
    ready = _standby(tmp_path)
    env = {**ready.env, "TF_CONFIG": _tf_config("worker")}
    proc = ready.take(env, stdout=tmp_path / "w.out", stderr=tmp_path / "w.log")
    assert proc is not None
    assert proc.wait(timeout=120) == 2
    assert "a ps standby cannot be worker 0" in (tmp_path / "w.log").read_text()


def test_a_standby_ends_with_its_input_and_refuses_a_bad_assignment(tmp_path: Path) -> None:
    env = {**harness.runtime_env(), standby.STANDBY_ENV: "ps"}
    command = [sys.executable, "-m", "jaxps_runtime"]
    ended = subprocess.run(
        command, env=env, input=b"", capture_output=True, timeout=120, check=False
    )
    assert ended.returncode == 0, ended.stderr.decode()
    bad = json.dumps({"env": {"JAX_PLATFORMS": "tpu"}, "stdout": "o", "stderr": "e"})
    refused = subprocess.run(
        command, env=env, input=bad.encode() + b"\n", capture_output=True, timeout=120, check=False
    )
    assert refused.returncode == 2
    assert "env: got JAX_PLATFORMS; a standby takes only" in refused.stderr.decode()
    wrong = subprocess.run(
        command,
        env={**env, standby.STANDBY_ENV: "worker"},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert wrong.returncode == 2
    assert "JAXPS_STANDBY: got 'worker'; allowed: ps" in wrong.stderr.decode()


def test_a_standby_that_died_is_replaced_and_the_ps_starts_as_a_new_process(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    job = harness.LocalJob.start(
        training={"steps": 100_000}, log_dir=tmp_path / "logs", ps=1, workers=1, standby=True
    )
    jobs.append(job)
    assert job.standby is not None
    dead = job.standby.process
    dead.kill()
    dead.wait(timeout=30)
    job.processes["ps-0"].kill()
    job.processes["ps-0"].wait(timeout=30)
    restarted = job.start_task("ps-0", metrics_port=job.metrics_ports["ps-0"])
    assert restarted is not dead
    assert restarted.poll() is None
    assert job.standby is not None
    assert job.standby.alive
    assert job.standby.process is not dead
    harness.wait_serving(job.spec["ps"][0], timeout=120, process=restarted)
    assert "started from the job's standby" not in (tmp_path / "logs" / "ps-0.log").read_text()
