"""The operator against a real kube-apiserver: what `kubectl apply -f examples/mnist.yaml` does.

Pod phases are written by the tests (there is no kubelet); everything else is the real
control plane and `jaxps operator` as its own process.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from jaxps_operator import kube
from jaxps_operator.policy import cleanup
from jaxps_runtime.config import cluster as tfcluster
from jaxps_runtime.process.metrics import Metrics
from tests.cluster.harness import (
    GROUP,
    PLURAL,
    VERSION,
    Cluster,
    Jobs,
    Operator,
    free_port,
    wait_for,
)
from tests.unit.test_manifests import CATALOGUE

ROOT = Path(__file__).resolve().parents[2]

MNIST = yaml.safe_load((ROOT / "examples" / "mnist.yaml").read_text())
PODS = ("mnist-ps-0", "mnist-ps-1", "mnist-worker-0", "mnist-worker-1")
# Where the apiserver's words differ from `jaxps validate`'s, what it says instead (the
# field is still named).
APISERVER_WORDS = {
    "wrong-api-version": 'strict decoding error: unknown field "spec"',
    "wrong-kind": 'kind: Invalid value: "TFJob": must be TrainingJob',
    "unknown-role": 'unknown field "spec.replicaSpecs.master"',
    "replicas-not-integer": "spec.replicaSpecs.ps.replicas in body must be of type integer",
    "unknown-training-field": 'unknown field "spec.training.stepz"',
    "suspend-not-boolean": "spec.runPolicy.suspend in body must be of type boolean",
}


def mnist(name: str = "mnist", **run_policy: Any) -> dict[str, Any]:
    job: dict[str, Any] = copy.deepcopy(MNIST)
    job["metadata"]["name"] = name
    job["spec"]["runPolicy"] = run_policy
    return job


def uids(pods: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {name: p["metadata"]["uid"] for name, p in pods.items()}


def run_all(jobs: Jobs, name: str = "mnist") -> None:
    for pod in jobs.wait_pods(name, 4):
        jobs.set_phase(pod, "Running")


def running_mnist(jobs: Jobs, **run_policy: Any) -> dict[str, str]:
    """Applies mnist, runs every pod, waits for Running; returns the pods' uids."""
    jobs.apply(mnist(**run_policy))
    run_all(jobs)
    jobs.wait_condition("mnist", "Running")
    return uids(jobs.pods("mnist"))


def test_the_crd_installs_and_the_apiserver_refuses_the_invalid_catalogue(crd: Cluster) -> None:
    names = crd.kubectl("get", "crd", "-o", "name")
    assert "customresourcedefinition.apiextensions.k8s.io/trainingjobs.jaxps.dev" in names
    refused = []
    for name, manifest, message in CATALOGUE:
        if not isinstance(manifest, dict):
            continue  # not an object: kubectl refuses to send it at all
        with pytest.raises(ApiException) as caught:
            crd.custom.create_namespaced_custom_object(
                GROUP,
                VERSION,
                "default",
                PLURAL,
                manifest,
                dry_run="All",
                field_validation="Strict",
            )
        assert caught.value.status in (400, 422), name
        said = json.loads(caught.value.body or "{}")["message"]
        assert APISERVER_WORDS.get(name, message) in said, f"{name}: {said}"
        refused.append(name)
    assert len(refused) == len(CATALOGUE) - 1
    # and every example is accepted
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        crd.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", str(path))


def test_mnist_creates_the_service_and_pods_with_owner_references_and_tf_config(
    jobs: Jobs,
) -> None:
    created = jobs.apply(mnist())
    pods = jobs.wait_pods("mnist", 4)
    assert sorted(pods) == sorted(PODS)
    service = wait_for(lambda: jobs.service("mnist"), what="the headless Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    for name, pod in pods.items():
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "TrainingJob",
            created["metadata"]["uid"],
            True,
        )
        assert pod["spec"]["hostname"] == name
        assert pod["spec"]["subdomain"] == "mnist"
        assert pod["spec"]["restartPolicy"] == "Never"
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        tf_config = tfcluster.parse_tf_config(env["TF_CONFIG"])
        role, index = name.split("-")[1], int(name.split("-")[2])
        assert (tf_config.task.type, tf_config.task.index) == (role, index)
        ns = jobs.namespace
        assert tf_config.cluster.jobs["ps"] == (
            f"mnist-ps-0.mnist.{ns}.svc:2222",
            f"mnist-ps-1.mnist.{ns}.svc:2222",
        )
        assert tf_config.cluster.jobs["worker"] == (
            f"mnist-worker-0.mnist.{ns}.svc:2222",
            f"mnist-worker-1.mnist.{ns}.svc:2222",
        )
        assert json.loads(env["JAXPS_TRAINING"])["mode"] == "sync"
        assert env["JAXPS_JOB_UID"] == created["metadata"]["uid"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "mnist-checkpoints"
    assert jobs.wait_condition("mnist", "Created")["reason"] == "JobCreated"

    def creations() -> str | None:
        said = " ".join(e["message"] for e in jobs.events("mnist") if e["reason"] == "Created")
        return said if all(f"Pod {p}" in said for p in PODS) else None

    assert "Service mnist" in wait_for(creations, what="an Event naming every created child")
    assert {"reason": "JobCreated", "type": "Normal", "message": "created TrainingJob mnist"} in (
        jobs.events("mnist")
    )


def test_a_service_deleted_by_hand_is_made_again_before_it_would_be_read_again(
    jobs: Jobs,
) -> None:
    jobs.apply(mnist())
    first = wait_for(lambda: jobs.service("mnist"), what="the headless Service")
    jobs.cluster.core.delete_namespaced_service("mnist", jobs.namespace)

    def again() -> dict[str, Any] | None:
        found = jobs.service("mnist")
        return found if found and found["metadata"]["uid"] != first["metadata"]["uid"] else None

    # the watch's event of the deletion: the Service is not taken as there for KEPT_FOR more
    made = wait_for(again, timeout=kube.KEPT_FOR * 0.8, what="the Service made again")
    assert made["spec"]["clusterIP"] == "None"


def test_pod_phases_drive_the_job_to_succeeded_and_running_pods_are_deleted(
    jobs: Jobs, operator: Operator
) -> None:
    running_mnist(jobs)
    jobs.wait_condition("mnist", "PodsReady")
    table = jobs.cluster.kubectl("get", "tj", "-n", jobs.namespace)
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "STATE", "READY", "RESTARTS", "STEP", "AGE"]
    assert row.split()[:4] == ["mnist", "Running", "4/4", "0"]

    jobs.set_phase("mnist-worker-1", "Succeeded")
    jobs.set_phase("mnist-worker-0", "Succeeded")  # worker 0 is the chief
    waited = jobs.cluster.kubectl(
        "wait",
        "--for=condition=Succeeded",
        "tj/mnist",
        "-n",
        jobs.namespace,
        "--timeout=60s",
    )
    assert "condition met" in waited
    job = jobs.get("mnist")
    assert job is not None
    assert job["status"]["state"] == "Succeeded"
    assert job["status"]["completionTime"]
    running = {c["type"]: c["status"] for c in job["status"]["conditions"]}["Running"]
    assert running == "False"
    # cleanPodPolicy Running: the ps, told to shut down, have a grace to end on their own
    # (their logs stay), then no ps outlives its job; the finished workers stay for their logs
    assert sorted(jobs.pods("mnist")) == sorted(PODS)
    wait_for(
        lambda: sorted(jobs.pods("mnist")) == ["mnist-worker-0", "mnist-worker-1"],
        timeout=cleanup.RUNNING_GRACE_SECONDS + 30,
        what="the running ps pods to be deleted after the grace",
    )
    assert len(jobs.wait_event("mnist", "JobSucceeded")) == 1
    assert 'jaxps_operator_jobs{state="Succeeded"}' in operator.metrics()


def test_a_failed_ps_pod_is_replaced_with_the_same_name_and_a_new_uid(
    jobs: Jobs, operator: Operator
) -> None:
    before = running_mnist(jobs)
    jobs.set_phase("mnist-ps-0", "Failed", exit_code=137)

    def replaced() -> dict[str, Any] | None:
        pod = jobs.pods("mnist").get("mnist-ps-0")
        return pod if pod and pod["metadata"]["uid"] != before["mnist-ps-0"] else None

    pod = wait_for(replaced, what="a new mnist-ps-0")
    assert pod["status"]["phase"] == "Pending"
    job = jobs.get("mnist")
    assert job is not None
    assert job["status"]["restarts"] == 1
    assert job["status"]["replicaStatuses"]["ps"]["restarts"] == 1
    restarting = jobs.wait_condition("mnist", "Restarting")
    assert "ps 0" in restarting["message"]
    after = uids(jobs.pods("mnist"))
    assert {k: v for k, v in after.items() if k != "mnist-ps-0"} == {
        k: v for k, v in before.items() if k != "mnist-ps-0"
    }
    jobs.wait_event("mnist", "PodsDeleted", "mnist-ps-0")
    replaced_events = jobs.wait_event("mnist", "PodReplaced", "ps 0")
    assert len(replaced_events) == 1
    assert "exit code 137" in replaced_events[0]["message"]
    assert "jaxps_operator_pod_replacements_total" in operator.metrics()
    # the new pod runs: the job is no longer restarting
    jobs.set_phase("mnist-ps-0", "Running")
    wait_for(
        lambda: jobs.condition("mnist", "Restarting") is None,
        what="the Restarting condition to clear",
    )
    assert (jobs.get("mnist") or {})["status"]["state"] == "Running"


def test_past_the_backoff_limit_the_job_fails(jobs: Jobs) -> None:
    first = running_mnist(jobs, backoffLimit=1)["mnist-ps-1"]
    jobs.set_phase("mnist-ps-1", "Failed", exit_code=137)
    second = wait_for(
        lambda: (
            (p := jobs.pods("mnist").get("mnist-ps-1"))
            and p["metadata"]["uid"] != first
            and p["metadata"]["uid"]
        ),
        what="the first replacement",
    )
    assert second
    jobs.set_phase("mnist-ps-1", "Failed", exit_code=1)
    failed = jobs.wait_condition("mnist", "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "backoffLimit (1)" in failed["message"]
    job = jobs.get("mnist")
    assert job is not None
    assert job["status"]["state"] == "Failed"
    # the failed job keeps no running pod
    wait_for(
        lambda: all(
            p["status"]["phase"] in ("Failed", "Succeeded") for p in jobs.pods("mnist").values()
        ),
        what="the running pods of the failed job to be deleted",
    )


def test_the_active_deadline_fails_the_job_with_no_other_event(jobs: Jobs) -> None:
    jobs.apply(mnist(activeDeadlineSeconds=3))
    jobs.wait_pods("mnist", 4)  # nothing else happens: the pods stay Pending
    failed = jobs.wait_condition("mnist", "Failed", timeout=60)
    assert failed["reason"] == "DeadlineExceeded"
    wait_for(lambda: not jobs.pods("mnist"), what="the pending pods to be deleted")


def test_ttl_deletes_the_finished_job_and_the_garbage_collector_its_children(
    jobs: Jobs,
) -> None:
    running_mnist(jobs, ttlSecondsAfterFinished=2, cleanPodPolicy="None")
    jobs.set_phase("mnist-worker-0", "Succeeded")
    jobs.wait_condition("mnist", "Succeeded")
    wait_for(lambda: jobs.get("mnist") is None, timeout=60, what="the job deleted by its TTL")

    def children_gone() -> bool:
        return not jobs.pods("mnist") and not jobs.service_names()

    wait_for(children_gone, timeout=120, what="the garbage collector to delete pods and Service")


def test_restarting_the_operator_mid_job_creates_no_duplicates(
    jobs: Jobs, operator: Operator
) -> None:
    before = running_mnist(jobs)
    assert operator.stop() == 0  # SIGTERM: a clean exit
    jobs.set_phase("mnist-worker-1", "Running", ready=False)  # happens while it is down
    operator.start()
    wait_for(
        lambda: (jobs.get("mnist") or {}).get("status", {}).get("readyReplicas") == "3/4",
        what="the restarted operator to see the change",
    )
    assert uids(jobs.pods("mnist")) == before
    assert jobs.service_names() == ["mnist"]
    job = jobs.get("mnist")
    assert job is not None
    assert job["status"]["restarts"] == 0
    reasons = [e["reason"] for e in jobs.events("mnist")]
    assert reasons.count("JobCreated") == 1
    assert reasons.count("JobRunning") == 1


def test_suspend_deletes_the_pods_and_resume_creates_them_again(jobs: Jobs) -> None:
    running_mnist(jobs)
    jobs.patch_spec("mnist", {"runPolicy": {"suspend": True}})
    jobs.wait_condition("mnist", "Suspended")
    wait_for(lambda: not jobs.pods("mnist"), what="every pod deleted on suspend")
    assert (jobs.get("mnist") or {})["status"]["state"] == "Suspended"
    jobs.patch_spec("mnist", {"runPolicy": {"suspend": False}})
    jobs.wait_pods("mnist", 4)
    wait_for(
        lambda: jobs.condition("mnist", "Suspended") is None,
        what="the Suspended condition to clear",
    )
    wait_for(
        lambda: {"JobSuspended", "JobResumed"} <= {e["reason"] for e in jobs.events("mnist")},
        what="the JobSuspended and JobResumed Events",
    )


def test_status_progress_is_read_from_the_chiefs_metrics(jobs: Jobs) -> None:
    port = free_port()
    manifest = mnist()
    manifest["spec"]["replicaSpecs"]["worker"]["template"] = {
        "spec": {
            "containers": [{"name": "jaxps", "ports": [{"name": "metrics", "containerPort": port}]}]
        }
    }
    metrics = Metrics(task="worker-0")  # the runtime's own metrics, as the chief serves them
    assert metrics.serve(port) == port
    metrics.global_step.set(42)
    metrics.loss.set(0.25)
    metrics.last_checkpoint_step.set(40)
    jobs.apply(manifest)
    pods = jobs.wait_pods("mnist", 4)
    main = pods["mnist-worker-0"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["JAXPS_METRICS_PORT"] == str(port)
    jobs.set_phase("mnist-worker-0", "Running", pod_ip="127.0.0.1")
    wait_for(
        lambda: (jobs.get("mnist") or {}).get("status", {}).get("progress", {}).get("step") == 42,
        what="status.progress.step 42",
    )
    metrics.global_step.set(43)  # read again while the chief runs
    wait_for(
        lambda: (jobs.get("mnist") or {}).get("status", {}).get("progress", {}).get("step") == 43,
        what="status.progress.step 43",
    )
    progress = (jobs.get("mnist") or {})["status"]["progress"]
    assert progress["loss"] == 0.25
    assert progress["lastCheckpointStep"] == 40
    row = jobs.cluster.kubectl("get", "tj", "-n", jobs.namespace).splitlines()[1].split()
    assert row[4] == "43"  # the STEP column
    summary = {"event": "done", "step": 50, "loss": 0.2, "eval": {"accuracy": 0.91}}
    jobs.set_phase("mnist-worker-0", "Succeeded", message=json.dumps(summary) + "\n")
    jobs.wait_condition("mnist", "Succeeded")
    wait_for(
        lambda: (jobs.get("mnist") or {})["status"]["progress"].get("eval") == {"accuracy": 0.91},
        what="the eval of the chief's termination message in status.progress",
    )
    assert (jobs.get("mnist") or {})["status"]["progress"]["step"] == 50


def test_a_misspelt_training_fails_at_once_with_no_pod(jobs: Jobs) -> None:
    manifest = mnist()
    manifest["spec"]["training"]["model"] = {"name": "resnet"}
    manifest["spec"]["training"]["optimizer"] = {"name": "sgdd"}
    jobs.apply(manifest)
    failed = jobs.wait_condition("mnist", "Failed")
    assert failed["reason"] == "InvalidTraining"
    assert "spec.training.model.name" in failed["message"]
    assert "spec.training.optimizer.name" in failed["message"]
    assert jobs.pods("mnist") == {}
    assert (jobs.get("mnist") or {})["status"]["restarts"] == 0


def test_a_task_refusing_its_training_fails_the_job_with_no_replacement(jobs: Jobs) -> None:
    uids_before = running_mnist(jobs)
    jobs.set_phase(
        "mnist-worker-1",
        "Failed",
        exit_code=78,
        message="JAXPS_TRAINING.model.module: 'mine:make' cannot be imported",
    )
    failed = jobs.wait_condition("mnist", "Failed")
    assert failed["reason"] == "InvalidTraining"
    assert "'mine:make' cannot be imported" in failed["message"]
    status = (jobs.get("mnist") or {})["status"]
    assert status["restarts"] == 0
    pods = jobs.pods("mnist")
    assert pods.get("mnist-worker-1", {}).get("metadata", {}).get("uid") in (
        None,
        uids_before["mnist-worker-1"],
    )  # never replaced


def test_the_jobs_secret_and_network_policy_are_owned_mounted_and_go_with_the_job(
    jobs: Jobs,
) -> None:
    created = jobs.apply(mnist())
    uid = created["metadata"]["uid"]
    pods = jobs.wait_pods("mnist", 4)
    core, net = jobs.cluster.core, client.NetworkingV1Api(jobs.cluster.core.api_client)
    name = f"mnist-tls-{uid[:8]}"
    secret = wait_for(
        lambda: _read(lambda: core.read_namespaced_secret(name, jobs.namespace)),
        what=f"the Secret {name}",
    )
    policy = wait_for(
        lambda: _read(lambda: net.read_namespaced_network_policy("mnist", jobs.namespace)),
        what="the NetworkPolicy mnist",
    )
    for owned in (secret, policy):
        assert owned.metadata.owner_references[0].uid == uid
    assert set(secret.data) == {"ca.crt"} | {f"{p}.{e}" for p in PODS for e in ("crt", "key")}
    assert policy.spec.pod_selector.match_labels == {"jaxps.dev/job-name": "mnist"}
    for pod_name, pod in pods.items():
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "jaxps-tls")
        assert volume["secret"]["secretName"] == name
        assert {i["key"] for i in volume["secret"]["items"]} == {
            "ca.crt",
            f"{pod_name}.crt",
            f"{pod_name}.key",
        }  # its own key only
    jobs.cluster.custom.delete_namespaced_custom_object(
        GROUP, VERSION, jobs.namespace, PLURAL, "mnist", propagation_policy="Background"
    )

    def gone() -> bool:
        return (
            _read(lambda: core.read_namespaced_secret(name, jobs.namespace)) is None
            and _read(lambda: net.read_namespaced_network_policy("mnist", jobs.namespace)) is None
        )

    wait_for(gone, timeout=120, what="the garbage collector to delete the Secret and policy")


def _read(read: Any) -> Any:
    try:
        return read()
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def test_a_pod_the_scheduler_cannot_place_is_named_then_fails_the_job_past_its_timeout(
    jobs: Jobs,
) -> None:
    jobs.apply(mnist(scheduleTimeoutSeconds=5))
    jobs.wait_pods("mnist", 4)
    # the control plane's scheduler has no node to place them on: it says so in PodScheduled,
    # and nothing but the operator's timer moves the job on

    def scheduler_words() -> str | None:
        for pod in jobs.pods("mnist").values():
            for c in pod["status"].get("conditions") or []:
                if c["type"] == "PodScheduled" and c["status"] == "False":
                    return str(c["message"])
        return None

    words = wait_for(scheduler_words, what="the scheduler's PodScheduled=False")
    failed = jobs.wait_condition("mnist", "Failed", timeout=60)
    assert failed["reason"] == "Unschedulable"
    assert f"runPolicy.scheduleTimeoutSeconds (5 s): Unschedulable: {words}" in failed["message"]
    name = failed["message"].split()[1]
    conditions = (jobs.get("mnist") or {})["status"]["conditions"]
    ready = next(c for c in conditions if c["type"] == "PodsReady")
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable")
    assert ready["message"].startswith(f"pod {name} (")
    # the pass writes the status, then posts its Events: wait for them, not just the status

    def warnings() -> list[dict[str, Any]] | None:
        found = [e for e in jobs.events("mnist") if e["reason"] == "Unschedulable"]
        return found if failed["message"] in [e["message"] for e in found] else None

    assert all(e["type"] == "Warning" for e in wait_for(warnings, what="the Failed Event"))
    wait_for(lambda: not jobs.pods("mnist"), what="the pending pods to be deleted")


def test_a_pod_template_the_apiserver_refuses_fails_the_job_with_its_words(
    jobs: Jobs, operator: Operator
) -> None:
    """A container name the API server refuses left the job Created forever: the 422 was in
    the operator's log only, retried without end, and the ps pod ran on."""
    job = mnist("refused")
    job["spec"]["replicaSpecs"]["worker"]["template"] = {
        "spec": {"containers": [{"name": "Main_Container"}]}
    }
    jobs.apply(job)
    failed = jobs.wait_condition("refused", "Failed")
    assert failed["reason"] == "InvalidTemplate", failed
    assert (
        "the API server refused a child of this job as invalid: Pod refused-worker-"
        in (failed["message"])
    ), failed
    assert 'spec.containers[0].name: Invalid value: "Main_Container"' in failed["message"]
    jobs.wait_event("refused", "CreateRefused", "Main_Container")
