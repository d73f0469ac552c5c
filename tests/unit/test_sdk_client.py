"""The SDK's pure parts: manifests in every form, typed views of a stored job, `wait`'s verdicts
(against an in-memory backend), `kubectl jaxps top`'s arithmetic, and no JAX on import."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from jaxps.sdk import (
    Client,
    Event,
    InvalidManifestError,
    JaxpsError,
    Job,
    JobFailedError,
    JobNotFoundError,
    LogLine,
    ScaleRefusedError,
    WaitTimeoutError,
    Workers,
    kubectl,
    load,
)
from jaxps.sdk.local import LocalBackend

ROOT = Path(__file__).resolve().parents[2]
MNIST = ROOT / "examples" / "mnist.yaml"


def stored(state: str = "", **status: Any) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load(MNIST.read_text())
    job["metadata"].update(namespace="ns", uid="u-1")
    job["status"] = {"state": state, **status} if state else dict(status)
    return job


def condition(type_: str, status: str = "True", reason: str = "R", message: str = "m") -> Any:
    return {"type": type_, "status": status, "reason": reason, "message": message}


class Memory:
    """A backend whose job moves through the given states, one per `get`."""

    where = "memory"

    def __init__(self, states: list[dict[str, Any]]) -> None:
        self.states = states
        self.reads = 0
        self.timeouts: list[float | None] = []  # each get's, as wait gave it
        self.scaled: list[int] = []

    def get(self, name: str, *, timeout: float | None = None) -> Job:
        self.timeouts.append(timeout)
        if name != "mnist":
            raise JobNotFoundError(name, self.where)
        raw = self.states[min(self.reads, len(self.states) - 1)]
        self.reads += 1
        return Job.of(raw)

    def create(self, manifest: Mapping[str, Any]) -> Job:
        return Job.of(manifest)

    def list(self) -> builtins.list[Job]:
        return [self.get("mnist")]

    def delete(self, name: str, *, wait: bool) -> None:
        pass

    def scale(self, name: str, workers: int) -> None:
        self.scaled.append(workers)

    def events(self, name: str) -> builtins.list[Event]:
        return []

    def logs(self, name: str, *, task: str | None, follow: bool) -> Iterator[LogLine]:
        return iter([])


def test_a_manifest_loads_from_a_file_a_path_text_or_a_dict_as_given() -> None:
    as_dict = yaml.safe_load(MNIST.read_text())
    for given in (MNIST, str(MNIST), MNIST.read_text(), as_dict):
        loaded = load(given)
        assert loaded == as_dict  # validated, but defaults are the API server's to apply
    assert "runPolicy" not in load(as_dict)["spec"]


def test_a_bad_manifest_names_every_field_and_a_missing_file_its_path() -> None:
    bad = yaml.safe_load(MNIST.read_text())
    bad["spec"]["training"]["mode"] = "sideways"
    bad["spec"]["training"]["batchSize"] = 0
    with pytest.raises(InvalidManifestError) as caught:
        load(bad)
    assert len(caught.value.problems) == 2
    assert "spec.training.mode" in str(caught.value)
    assert "sideways" in str(caught.value)
    assert "spec.training.batchSize" in str(caught.value)
    bad = yaml.safe_load(MNIST.read_text())
    bad["spec"]["training"]["optimizer"]["name"] = "adamm"
    with pytest.raises(InvalidManifestError, match="adamm"):
        load(bad)
    with pytest.raises(JaxpsError, match=r"nope\.yaml: cannot read it"):
        load("nope.yaml")
    with pytest.raises(InvalidManifestError, match="not YAML"):
        load("kind: [unclosed\n")


def test_a_stored_job_without_steps_reads_the_runtimes_default() -> None:
    """The apiserver stores no default of spec.training: the SDK says what the job runs."""
    raw = stored("Running", progress={"step": 5})
    del raw["spec"]["training"]["steps"]
    assert Job.of(raw).progress.steps == 1000
    raw["spec"]["training"]["steps"] = "many"  # not a number: no total
    assert Job.of(raw).progress.steps == 0


def test_a_stored_job_reads_as_typed_fields() -> None:
    job = Job.of(
        stored(
            "Running",
            conditions=[condition("Running", reason="JobRunning")],
            progress={"step": 120, "loss": 0.25, "stepsPerSecond": 40.5, "eval": {"acc": 0.9}},
            replicaStatuses={"ps": {"active": 2, "ready": 2}, "worker": {"restarts": 1}},
            restarts=1,
            startTime="2026-11-23T03:00:00Z",
        )
    )
    assert (job.name, job.namespace, job.state, job.restarts) == ("mnist", "ns", "Running", 1)
    assert job.progress.step == 120
    assert job.progress.steps == 600
    assert job.progress.loss == 0.25
    assert job.progress.eval == {"acc": 0.9}
    assert job.progress.last_checkpoint_step is None
    running = job.condition("Running")
    assert running is not None
    assert running.status
    assert running.reason == "JobRunning"
    ps = next(r for r in job.replicas if r.role == "ps")
    assert (ps.replicas, ps.active, ps.ready) == (2, 2, 2)
    assert job.start_time is not None
    assert job.start_time.tzinfo is not None
    assert not job.finished


def test_wait_returns_once_the_condition_is_true() -> None:
    client = Client(
        Memory(
            [stored(), stored("Running"), stored("Succeeded", conditions=[condition("Succeeded")])]
        )
    )
    job = client.wait("mnist", timeout=5, interval=0.01)
    assert job.state == "Succeeded"


def test_wait_for_success_of_a_failed_job_says_why_at_once() -> None:
    failed = stored(
        "Failed", conditions=[condition("Failed", reason="BackoffLimitExceeded", message="ps 0")]
    )
    client = Client(Memory([stored("Running"), failed]))
    with pytest.raises(JobFailedError, match=r"mnist is Failed \(BackoffLimitExceeded: ps 0\)"):
        client.wait("mnist", timeout=60, interval=0.01)
    assert client.wait("mnist", "Failed", timeout=1).state == "Failed"


def test_wait_times_out_naming_the_job_condition_and_where_it_is() -> None:
    client = Client(Memory([stored("Running", progress={"step": 7})]))
    with pytest.raises(
        WaitTimeoutError, match=r"mnist: not Succeeded after 0\.05 s; it is Running at step 7"
    ):
        client.wait("mnist", timeout=0.05, interval=0.01)
    with pytest.raises(JobNotFoundError, match="TrainingJob other not found in memory"):
        client.wait("other")


def test_no_request_of_wait_may_outlive_its_deadline() -> None:
    backend = Memory([stored("Running")])
    with pytest.raises(WaitTimeoutError):
        Client(backend).wait("mnist", timeout=0.3, interval=0.05)
    assert all(t is not None and t <= 0.3 for t in backend.timeouts), backend.timeouts
    assert backend.timeouts[-1] == pytest.approx(0.1, abs=0.05)  # the last: what was left


@pytest.mark.parametrize("condition", ["Complete", "succeeded", "Ready", ""])
def test_wait_for_a_condition_a_job_never_has_is_refused_before_any_read(condition: str) -> None:
    backend = Memory([stored("Running")])
    with pytest.raises(ValueError, match=f"condition {condition!r} is not one") as caught:
        Client(backend).wait("mnist", condition)
    assert str(caught.value).endswith(
        "expected one of Created, PodsReady, Running, Restarting, Succeeded, Failed, Suspended, "
        "Queued, Admitted, Preempted, ScalingLimited"
    )
    assert backend.reads == 0


def test_top_reads_a_tasks_metrics_and_rates_its_bytes() -> None:
    text = "\n".join(
        [
            "# TYPE jaxps_global_step gauge",
            'jaxps_global_step{task="ps-0"} 120.0',
            "# TYPE jaxps_bytes_pushed counter",
            'jaxps_bytes_pushed_total{task="ps-0"} 5000000.0',
            "# TYPE jaxps_bytes_pulled counter",
            'jaxps_bytes_pulled_total{task="ps-0"} 1000.0',
            "# TYPE jaxps_eval gauge",
            'jaxps_eval{task="ps-0",metric="accuracy"} 0.9',
            "",
        ]
    )
    values = kubectl.parse_metrics(text)
    assert values["jaxps_global_step"] == 120.0
    assert values["jaxps_bytes_pushed_total"] == 5e6
    assert not any(k.startswith("jaxps_eval") for k in values)
    before = kubectl.Sample(at=10.0, values={**values, "jaxps_bytes_pushed_total": 1e6})
    now = kubectl.Sample(at=12.0, values=values)
    assert kubectl.top_row(before, now, role="ps") == ["120", "-", "-", "-", "2.0 MB/s", "0 B/s"]
    assert kubectl.top_row(None, now, role="ps")[4] == "-"  # a rate needs two samples
    # a role shows what it reports: a worker's unset gauges read "-", not 0
    assert kubectl.top_row(before, now, role="worker") == ["120", "-", "-", "-", "-", "-"]
    chief = kubectl.top_row(before, now, role="worker", chief=True)
    assert chief[:3] == ["120", "-", "-"]  # no loss or rate in these metrics yet
    with_loss = kubectl.Sample(at=12.0, values={**values, "jaxps_loss": 0.25})
    assert kubectl.top_row(None, with_loss, role="worker")[1] == "0.2500"


def test_kubectl_jaxps_refuses_bad_flags_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        kubectl.main(["wait", "mnist", "--timeout", "-3"])
    assert caught.value.code == 2
    assert "--timeout: got '-3'" in capsys.readouterr().err


def test_the_sdk_imports_no_jax_numpy_or_grpc() -> None:
    code = (
        "import sys, jaxps.sdk, jaxps.sdk.kubectl, jaxps.sdk.local, jaxps.sdk.kubernetes;"
        "print(sorted(m for m in ('jax', 'numpy', 'grpc', 'optax') if m in sys.modules))"
    )
    path = os.pathsep.join(str(ROOT / root) for root in ("runtime", "operator"))
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.stdout.strip() == "[]"


# --- scale ----------------------------------------------------------------------------------


def running(**worker: Any) -> dict[str, Any]:
    job = stored("Running", workers={"desired": 2, "active": 2, "leaving": 0, "max": 2})
    job["spec"]["replicaSpecs"]["worker"].update(worker)
    return job


def test_scale_within_bounds_goes_to_the_backend_and_returns_the_job() -> None:
    backend = Memory([running(maxReplicas=4) | {"status": {"state": "Running"}}])
    job = Client(backend).scale("mnist", 4)
    assert backend.scaled == [4]
    assert job.name == "mnist"


@pytest.mark.parametrize(
    ("state", "workers", "words"),
    [
        (running(), 3, "above the 2 workers whose certificates were issued"),
        (running(maxReplicas=4), 5, "above spec.replicaSpecs.worker.maxReplicas 4"),
        (running(minReplicas=2, maxReplicas=4), 1, "below spec.replicaSpecs.worker.minReplicas 2"),
        (stored("Succeeded"), 1, "the job is Succeeded: nothing runs to scale"),
        (running(), True, "is not an integer"),
    ],
    ids=["above-issued", "above-max", "below-min", "finished", "not-an-integer"],
)
def test_a_refused_scale_raises_naming_the_field_and_never_reaches_the_backend(
    state: dict[str, Any], workers: int, words: str
) -> None:
    backend = Memory([state])
    with pytest.raises(ScaleRefusedError) as caught:
        Client(backend).scale("mnist", workers)
    assert words in str(caught.value)
    assert "TrainingJob mnist: scale to" in str(caught.value)
    assert backend.scaled == []


def test_status_workers_and_progress_data_read_as_typed_fields() -> None:
    job = Job.of(
        stored(
            "Running",
            workers={"desired": 3, "active": 2, "leaving": 1, "max": 4, "selector": "a=b"},
            progress={"step": 5, "data": {"epoch": 1, "shardsDone": 3}},
        )
    )
    assert job.workers == Workers(desired=3, active=2, leaving=1, max=4)
    assert job.progress.data == {"epoch": 1, "shardsDone": 3}


RUNNER = """
import sys, time
from pathlib import Path
from jaxps_operator import local, schema  # the stand-in runner: jaxps_operator in its cmdline
workdir = Path(sys.argv[1])
job = schema.load((workdir / "manifest.yaml").read_text())
here = local.LocalCluster(job=local.local_job(job, workdir), workdir=workdir)
while not (workdir / "stop").exists():
    here.answer_requests()
    time.sleep(0.05)
"""


def test_the_local_backend_scales_through_the_runner_and_says_why_it_refuses(
    tmp_path: Path,
) -> None:
    job = running(maxReplicas=3)
    job["status"] = {}
    workdir = tmp_path / "mnist"
    workdir.mkdir()
    (workdir / "manifest.yaml").write_text(
        yaml.safe_dump({k: v for k, v in job.items() if k != "status"})
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}"}
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(workdir)], env=env)
    try:
        (workdir / "runner.pid").write_text(str(runner.pid))
        backend = LocalBackend(root=tmp_path)
        deadline = time.monotonic() + 60
        while not (workdir / "job.json").exists():
            assert runner.poll() is None, "the stand-in runner exited"
            assert time.monotonic() < deadline, "the stand-in runner wrote no job.json"
            time.sleep(0.05)
        Client(backend).scale("mnist", 3)
        assert backend.get("mnist").raw["spec"]["replicaSpecs"]["worker"]["replicas"] == 3
        # past what the client checks (no status yet), the runner refuses: said as the error
        with pytest.raises(ScaleRefusedError, match="maxReplicas 3"):
            backend.scale("mnist", 4)
    finally:
        (workdir / "stop").write_text("")
        runner.wait(timeout=30)
