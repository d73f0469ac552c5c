"""The SDK's Kubernetes backend and `kubectl jaxps` against the real API server and operator
(pod phases are written by the test: this tier has no node)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxps.sdk import Client, InvalidManifestError, JobExistsError, JobNotFoundError
from tests.cluster.harness import ROOT, Jobs, Operator, wait_for
from tests.cluster.test_operator import mnist, run_all


def kubectl_jaxps(jobs: Jobs, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl jaxps ARGS` as kubectl runs a plugin: the executable with the plugin's args."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxps.sdk.kubectl",
            *args,
            "-n",
            jobs.namespace,
            "--kubeconfig",
            str(jobs.cluster.kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def test_the_sdk_creates_follows_and_deletes_a_job_on_the_cluster(
    jobs: Jobs, operator: Operator
) -> None:
    client = Client.kubernetes(namespace=jobs.namespace, kubeconfig=jobs.cluster.kubeconfig)
    job = client.create(mnist())
    assert (job.name, job.namespace) == ("mnist", jobs.namespace)
    assert job.uid
    with pytest.raises(JobExistsError, match="TrainingJob mnist already exists in namespace"):
        client.create(mnist())
    bad = mnist("typo")
    bad["spec"]["training"]["stepz"] = 5
    with pytest.raises(InvalidManifestError, match=r"spec\.training\.stepz"):
        client.create(bad)
    assert jobs.get("typo") is None  # refused before the API server saw it

    run_all(jobs)
    running = client.wait("mnist", "Running", timeout=60, interval=0.2)
    assert running.state == "Running"
    assert [j.name for j in client.list()] == ["mnist"]
    ready = client.wait("mnist", "PodsReady", timeout=60, interval=0.2)
    assert sum(r.ready for r in ready.replicas) == 4

    got = kubectl_jaxps(jobs, "get")
    assert got.returncode == 0, got.stderr
    header, row = got.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "STATE", "READY", "RESTARTS", "STEP", "LOSS", "AGE"]
    assert row.split()[:5] == ["mnist", "Running", "4/4", "0", "0/600"]
    described = kubectl_jaxps(jobs, "describe", "mnist")
    assert described.returncode == 0, described.stderr
    for shown in (
        "State:",
        "Running",
        "Replicas",
        "Conditions",
        "PodsReady",
        "Events",
        "JobRunning",
    ):
        assert shown in described.stdout, described.stdout

    jobs.set_phase("mnist-worker-1", "Succeeded")
    jobs.set_phase("mnist-worker-0", "Succeeded")
    waited = kubectl_jaxps(jobs, "wait", "mnist", "--for", "condition=Succeeded", "--timeout", "60")
    assert waited.returncode == 0, waited.stderr
    assert "condition met" in waited.stdout
    done = client.get("mnist")
    assert done.finished
    assert done.completion_time is not None
    assert any(e.reason == "JobSucceeded" for e in client.events("mnist"))
    failed = kubectl_jaxps(jobs, "wait", "mnist", "--for", "condition=Failed", "--timeout", "5")
    assert failed.returncode == 1
    assert "mnist is Succeeded" in failed.stderr

    deleted = kubectl_jaxps(jobs, "delete", "mnist")
    assert deleted.returncode == 0, deleted.stderr
    with pytest.raises(JobNotFoundError, match=f"mnist not found in namespace {jobs.namespace}"):
        client.get("mnist")
    wait_for(lambda: not jobs.pods("mnist"), what="the job's pods to go")
    missing = kubectl_jaxps(jobs, "describe", "mnist")
    assert missing.returncode == 2
    assert "TrainingJob mnist not found" in missing.stderr


def test_kubectl_jaxps_describe_shows_a_users_words_in_brackets_as_they_are(
    jobs: Jobs, operator: Operator
) -> None:
    """A user's exception text is in the Failed condition and its Event; rich read `[/x]` in it
    as markup and `describe` crashed (MarkupError), or dropped `[bold]`."""
    client = Client.kubernetes(namespace=jobs.namespace, kubeconfig=jobs.cluster.kubeconfig)
    client.create(mnist())
    run_all(jobs)
    client.wait("mnist", "Running", timeout=60, interval=0.2)
    words = "ValueError: expected [/batch] got [bold]x"
    jobs.set_phase("mnist-worker-0", "Failed", exit_code=79, message=words)
    client.wait("mnist", "Failed", timeout=60, interval=0.2)
    described = kubectl_jaxps(jobs, "describe", "mnist")
    assert described.returncode == 0, described.stderr
    assert words in " ".join(described.stdout.split()), described.stdout
