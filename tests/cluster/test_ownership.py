"""Objects with a name the job needs that the job does not own (no ownerReference with its
uid) are never adopted, changed or deleted: the job fails NameTaken naming the object. And the
jaxps container is found by its name wherever the template lists it: a sidecar listed first
keeps its own image."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.cluster.harness import Jobs, Operator
from tests.cluster.test_operator import mnist

BUSYBOX = "busybox:1.36"


def _failed(jobs: Jobs, name: str) -> dict[str, Any]:
    failed = jobs.wait_condition(name, "Failed")
    assert failed["reason"] == "NameTaken", failed
    return failed


def made(jobs: Jobs, body: dict[str, Any]) -> dict[str, Any]:
    """Creates `body` in the test's namespace as someone else would (kubectl); what was made."""
    out = jobs.cluster.kubectl(
        "create", "-n", jobs.namespace, "-o", "json", "-f", "-", stdin=json.dumps(body)
    )
    return dict(json.loads(out))


def read(jobs: Jobs, kind: str, name: str) -> dict[str, Any]:
    return dict(
        json.loads(jobs.cluster.kubectl("get", "-n", jobs.namespace, kind, name, "-o", "json"))
    )


def _someone_elses_pod(jobs: Jobs, name: str, labels: dict[str, str]) -> dict[str, Any]:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "theirs", "image": BUSYBOX}]},
    }
    return made(jobs, pod)


@pytest.mark.parametrize(
    "labels",
    [
        {},
        {
            "jaxps.dev/job-name": "mnist",
            "jaxps.dev/replica-type": "worker",
            "jaxps.dev/replica-index": "0",
        },
    ],
    ids=["unlabelled", "with-the-jobs-labels"],
)
def test_someone_elses_pod_with_a_workers_name_fails_the_job_name_taken_and_is_left(
    jobs: Jobs, operator: Operator, labels: dict[str, str]
) -> None:
    before = _someone_elses_pod(jobs, "mnist-worker-0", labels)
    jobs.apply(mnist())
    failed = _failed(jobs, "mnist")
    assert (
        "Pod mnist-worker-0 holds a name this job needs and is not the job's" in failed["message"]
    )
    pod = read(jobs, "pod", "mnist-worker-0")
    # not deleted and made again, nor changed (the scheduler alone writes its status)
    assert pod["metadata"]["uid"] == before["metadata"]["uid"]
    assert "deletionTimestamp" not in pod["metadata"]
    assert "ownerReferences" not in pod["metadata"]
    assert pod["metadata"].get("labels", {}) == labels
    assert "annotations" not in pod["metadata"]
    assert pod["spec"]["containers"] == before["spec"]["containers"]


def test_someone_elses_service_with_the_jobs_name_fails_it_name_taken_and_is_left(
    jobs: Jobs, operator: Operator
) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "mnist"},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]},
    }
    before = made(jobs, service)
    jobs.apply(mnist())
    failed = _failed(jobs, "mnist")
    assert "Service mnist holds a name this job needs" in failed["message"], failed
    assert "(its owner: nothing)" in failed["message"]
    after = read(jobs, "service", "mnist")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert jobs.pods("mnist") == {}  # no pod started behind someone else's Service


def test_a_sidecar_listed_first_keeps_its_image_and_the_jaxps_container_gets_its_own(
    jobs: Jobs, operator: Operator
) -> None:
    job = mnist()
    sidecar = {"name": "log-shipper", "image": BUSYBOX, "command": ["sleep", "3600"]}
    for spec in job["spec"]["replicaSpecs"].values():
        template = spec.setdefault("template", {}).setdefault("spec", {})
        template["containers"] = [copy.deepcopy(sidecar), {"name": "jaxps"}]
    jobs.apply(job)
    pods = jobs.wait_pods("mnist", 4)
    for pod in pods.values():
        first, main = pod["spec"]["containers"]
        assert (first["name"], first["image"], first["command"]) == (
            "log-shipper",
            BUSYBOX,
            ["sleep", "3600"],
        )
        assert "env" not in first
        assert main["name"] == "jaxps"
        assert main["image"].startswith("ghcr.io/jaxps/runtime")
        assert any(e["name"] == "TF_CONFIG" for e in main["env"])
