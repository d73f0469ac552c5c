"""Elastic workers against a real kube-apiserver and `jaxps operator`: `kubectl scale` and the
scale subresource, the CRD's refusals (a ps count that changes, replicas outside minReplicas ..
maxReplicas), the operator's (more workers than were issued), status.workers, and the pods a
scale adds and deletes. There is no kubelet: the tests write the pods' phases."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from jaxps.sdk import Client, ScaleRefusedError
from jaxps.sdk.kubernetes import KubernetesBackend
from tests.cluster.harness import GROUP, PLURAL, VERSION, Jobs, wait_for

ROOT = Path(__file__).resolve().parents[2]
MNIST = yaml.safe_load((ROOT / "examples" / "mnist.yaml").read_text())


def elastic(name: str = "elastic", **worker: Any) -> dict[str, Any]:
    job: dict[str, Any] = copy.deepcopy(MNIST)
    job["metadata"]["name"] = name
    job["spec"]["replicaSpecs"]["ps"]["replicas"] = 1
    job["spec"]["replicaSpecs"]["worker"].update({"replicas": 2, **worker})
    return job


def kubectl_scale(jobs: Jobs, name: str, replicas: int) -> str:
    return jobs.cluster.kubectl(
        "scale", f"tj/{name}", f"--replicas={replicas}", "-n", jobs.namespace, check=False
    )


def live(jobs: Jobs, name: str) -> dict[str, str]:
    """The pods not being deleted, by name, with their uids."""
    return {
        n: p["metadata"]["uid"]
        for n, p in jobs.pods(name).items()
        if not p["metadata"].get("deletionTimestamp")
    }


def live_when(jobs: Jobs, name: str, count: int) -> dict[str, str] | None:
    """The live pods once there are `count` of them, else None."""
    pods = live(jobs, name)
    return pods if len(pods) == count else None


def workers(jobs: Jobs, name: str) -> dict[str, Any]:
    return dict(((jobs.get(name) or {}).get("status") or {}).get("workers") or {})


def running(jobs: Jobs, name: str, count: int) -> dict[str, str]:
    for pod in jobs.wait_pods(name, count):
        jobs.set_phase(pod, "Running")
    jobs.wait_condition(name, "Running")
    return live(jobs, name)


def test_kubectl_scale_adds_workers_then_drains_the_highest_indexes(jobs: Jobs) -> None:
    jobs.apply(elastic(maxReplicas=4))
    before = running(jobs, "elastic", 3)
    wait_for(lambda: workers(jobs, "elastic").get("active") == 2, what="2 active workers")
    out = kubectl_scale(jobs, "elastic", 4)
    assert "scaled" in out, out
    pods = wait_for(
        lambda: live_when(jobs, "elastic", 5),
        what="worker-2 and worker-3 created",
    )
    assert sorted(pods) == sorted([*before, "elastic-worker-2", "elastic-worker-3"])
    assert all(pods[n] == uid for n, uid in before.items())  # no pod that runs is made again
    tf = json.loads(
        next(
            e["value"]
            for e in jobs.pods("elastic")["elastic-worker-3"]["spec"]["containers"][0]["env"]
            if e["name"] == "TF_CONFIG"
        )
    )
    assert len(tf["cluster"]["worker"]) == 4
    jobs.wait_event("elastic", "ScaledUp", "worker replicas 2 -> 4")
    for pod in ("elastic-worker-2", "elastic-worker-3"):
        jobs.set_phase(pod, "Running")
    wait_for(lambda: workers(jobs, "elastic").get("summary") == "4/4", what="status.workers 4/4")
    # the scale subresource, as a HorizontalPodAutoscaler reads it
    scale = cast(
        dict[str, Any],
        jobs.cluster.custom.get_namespaced_custom_object_scale(
            GROUP, VERSION, jobs.namespace, PLURAL, "elastic"
        ),
    )
    assert scale["spec"]["replicas"] == 4
    assert scale["status"]["replicas"] == 4
    assert scale["status"]["selector"] == (
        "jaxps.dev/job-name=elastic,jaxps.dev/replica-type=worker"
    )

    assert "scaled" in kubectl_scale(jobs, "elastic", 1)
    jobs.wait_event("elastic", "ScaledDown", "worker replicas 4 -> 1: worker-3, worker-2, worker-1")
    left = wait_for(
        lambda: live_when(jobs, "elastic", 2),
        what="workers 1..3 deleted",
    )
    assert left == {n: before[n] for n in ("elastic-ps-0", "elastic-worker-0")}
    status = (jobs.get("elastic") or {})["status"]
    assert status["restarts"] == 0
    assert status["state"] == "Running"
    assert status["workers"]["desired"] == 1


def test_the_apiserver_refuses_a_ps_change_and_workers_outside_min_and_max(jobs: Jobs) -> None:
    jobs.apply(elastic(minReplicas=2, maxReplicas=3))
    with pytest.raises(ApiException) as caught:
        jobs.patch_spec("elastic", {"replicaSpecs": {"ps": {"replicas": 2}}})
    said = json.loads(caught.value.body or "{}")["message"]
    assert "spec.replicaSpecs.ps.replicas: Forbidden" in said
    assert "spec.replicaSpecs.ps.replicas cannot change while the job exists" in said
    assert "sharded over the ps tasks" in said
    assert "delete the job and create it again" in said
    # spec.training too: a replaced pod got the edited training (another model's layout), its
    # reads were refused, and the job failed BackoffLimitExceeded naming no edit
    with pytest.raises(ApiException) as caught:
        jobs.patch_spec("elastic", {"training": {"steps": 100_000}})
    said = json.loads(caught.value.body or "{}")["message"]
    assert "spec.training: Forbidden: spec.training cannot change while the job exists" in said
    above = kubectl_scale(jobs, "elastic", 4)
    assert (
        "spec.replicaSpecs.worker.replicas is above spec.replicaSpecs.worker.maxReplicas: "
        "allowed minReplicas..maxReplicas"
    ) in above
    below = kubectl_scale(jobs, "elastic", 1)
    assert (
        "spec.replicaSpecs.worker.replicas is below spec.replicaSpecs.worker.minReplicas"
    ) in below
    job = jobs.get("elastic") or {}
    assert job["spec"]["replicaSpecs"]["worker"]["replicas"] == 2
    assert job["spec"]["replicaSpecs"]["ps"]["replicas"] == 1


def test_a_job_without_max_replicas_is_refused_more_workers_than_it_was_issued(
    jobs: Jobs,
) -> None:
    jobs.apply(elastic())
    running(jobs, "elastic", 3)
    assert "scaled" in kubectl_scale(jobs, "elastic", 3)  # the CRD cannot know: the operator
    limited = jobs.wait_condition("elastic", "ScalingLimited")
    assert "spec.replicaSpecs.worker.replicas 3 is above the 2 workers" in limited["message"]
    assert "spec.replicaSpecs.worker.maxReplicas" in limited["message"]
    assert "allowed 1..2" in limited["message"]
    jobs.wait_event("elastic", "ScaleRefused", "allowed 1..2")
    assert "elastic-worker-2" not in jobs.pods("elastic")
    assert workers(jobs, "elastic")["max"] == 2


def test_the_sdk_scales_through_the_subresource_and_raises_the_refusals(jobs: Jobs) -> None:
    jobs.apply(elastic(maxReplicas=3))
    running(jobs, "elastic", 3)
    client = Client(
        KubernetesBackend(namespace=jobs.namespace, kubeconfig=str(jobs.cluster.kubeconfig))
    )
    client.scale("elastic", 3)
    wait_for(lambda: "elastic-worker-2" in live(jobs, "elastic"), what="worker-2 created")
    with pytest.raises(ScaleRefusedError, match=r"maxReplicas 3: allowed 1\.\.3"):
        client.scale("elastic", 4)
    # past the SDK's own check, the API server's words come back as the same error
    backend = KubernetesBackend(namespace=jobs.namespace, kubeconfig=str(jobs.cluster.kubeconfig))
    with pytest.raises(ScaleRefusedError, match=r"above spec\.replicaSpecs\.worker\.maxReplicas:"):
        backend.scale("elastic", 4)
    assert client.get("elastic").workers.desired == 3
