"""The SDK's local backend: real `jaxps local` runners in the background, real training."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from jaxps.sdk import Client, JobExistsError, JobNotFoundError
from tests.process import harness
from tests.process.test_local import alive_with_job_name

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[2]
KEPT = ROOT / ".work" / "sdk"


def manifest(name: str, *, steps: int) -> dict[str, Any]:
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {"ps": {"replicas": 1}, "worker": {"replicas": 2}},
            "training": {
                "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
                "dataset": {"name": "digits"},
                "steps": steps,
                "batchSize": 16,
                "logEverySeconds": 1,
            },
        },
    }


def until(condition: Any, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    made = Client.local(root=tmp_path / "jobs")
    yield made
    for job in made.list():  # whatever a test left running stops
        made.delete(job.name)


def test_the_example_script_creates_waits_for_and_deletes_mnist_locally(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sdk_mnist.py"), "--root", str(tmp_path)],
        env=harness.runtime_env({"PYTHONPATH": os.pathsep.join([str(ROOT / "operator")])}),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "mnist: Succeeded after 600 steps" in done.stdout
    assert '"accuracy": 0.9' in done.stdout
    assert "deleted mnist" in done.stdout
    assert not (tmp_path / "mnist").exists()
    assert not alive_with_job_name("mnist")
    KEPT.mkdir(parents=True, exist_ok=True)
    (KEPT / "local.txt").write_text(
        f"$ python examples/sdk_mnist.py --root {tmp_path}\n{done.stdout}"
    )


def test_a_local_job_is_listed_followed_and_deleted_with_every_process(client: Client) -> None:
    name = f"sdk-{uuid.uuid4().hex[:6]}"
    job = client.create(manifest(name, steps=1_000_000))
    assert job.name == name
    with pytest.raises(JobExistsError, match=f"TrainingJob {name} already exists"):
        client.create(manifest(name, steps=10))
    running = client.wait(name, "Running", timeout=300, interval=0.2)
    assert running.state == "Running"
    assert [j.name for j in client.list()] == [name]
    until(lambda: client.progress(name).step > 0, timeout=300, what="a global step")
    lines = [line.text for line in client.logs(name, "worker-1")]
    assert any("worker-1" in text for text in lines), lines[-5:]
    assert {line.task for line in client.logs(name)} == {
        f"{name}-{task}" for task in ("ps-0", "worker-0", "worker-1")
    }
    assert any(e.reason == "JobRunning" for e in client.events(name))
    assert alive_with_job_name(name)

    client.delete(name)
    assert not alive_with_job_name(name)
    with pytest.raises(JobNotFoundError, match=f"TrainingJob {name} not found"):
        client.get(name)
    assert client.list() == []


def test_following_every_log_ends_when_the_job_does(client: Client) -> None:
    name = f"sdk-{uuid.uuid4().hex[:6]}"
    client.create(manifest(name, steps=60))
    seen: dict[str, int] = {}
    for line in client.logs(name, follow=True):  # returns once the runner is done
        seen[line.task] = seen.get(line.task, 0) + 1
    assert set(seen) == {f"{name}-{task}" for task in ("ps-0", "worker-0", "worker-1")}
    job = client.get(name)
    assert job.state == "Succeeded"
    assert job.progress.step == 60
    assert job.completion_time is not None
    stored = yaml.safe_load((Path(client.backend.where) / name / "manifest.yaml").read_text())
    assert stored == manifest(name, steps=60)  # the manifest as given, next to the job
    assert not alive_with_job_name(name)
