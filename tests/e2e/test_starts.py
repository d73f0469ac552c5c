"""Starts that do not progress on the real node are named at once and bounded by
`runPolicy.scheduleTimeoutSeconds`; a sidecar listed first keeps its own image and one that
never exits keeps neither the job nor its pods alive; someone else's pod with a worker's name is
never taken: the job fails NameTaken."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.cluster.harness import wait_for
from tests.cluster.test_ownership import made, read
from tests.e2e.harness import E2eJobs, keep

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
TIMEOUT = 20  # runPolicy.scheduleTimeoutSeconds of the stuck jobs
SLEEP = ["python", "-c", "import time; time.sleep(3600)"]


def small_job(name: str, *, worker: dict[str, Any] | None = None, **run: Any) -> dict[str, Any]:
    """1 ps and 1 worker training 50 steps, no checkpoint claim; `worker`: its pod spec."""
    spec: dict[str, Any] = {"replicas": 1}
    if worker is not None:
        spec["template"] = {"spec": worker}
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {"ps": {"replicas": 1}, "worker": spec},
            "training": {
                "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
                "dataset": {"name": "digits"},
                "steps": 50,
                "batchSize": 32,
            },
            "runPolicy": run,
        },
    }


def pods_ready_false(jobs: E2eJobs, name: str, reason: str) -> dict[str, Any]:
    def said() -> dict[str, Any] | None:
        conditions = ((jobs.get(name) or {}).get("status") or {}).get("conditions") or []
        for c in conditions:
            if (c["type"], c["status"], c.get("reason")) == ("PodsReady", "False", reason):
                return dict(c)
        return None

    return wait_for(said, timeout=120, what=f"PodsReady False {reason} on {name}")


def failed_past_the_timeout(jobs: E2eJobs, name: str, reason: str) -> str:
    failed = jobs.wait_condition(name, "Failed", timeout=180)
    assert failed["reason"] == reason, failed
    waited = re.fullmatch(
        rf"pod {name}-worker-0 \(worker 0\) waited (\d+) s, past "
        rf"runPolicy.scheduleTimeoutSeconds \({TIMEOUT} s\): (.+)",
        failed["message"],
    )
    assert waited, failed["message"]
    assert int(waited.group(1)) >= TIMEOUT
    wait_for(lambda: not jobs.pods(name), timeout=120, what=f"every pod of {name} deleted")
    return str(waited.group(2))


def test_a_secret_the_worker_mounts_that_does_not_exist_is_named_then_fails_mount_failed(
    jobs: E2eJobs,
) -> None:
    worker = {
        "containers": [
            {"name": "jaxps", "volumeMounts": [{"name": "creds", "mountPath": "/creds"}]}
        ],
        "volumes": [{"name": "creds", "secret": {"secretName": "absent"}}],
    }
    name = str(
        jobs.apply(small_job("mount", worker=worker, scheduleTimeoutSeconds=TIMEOUT))["metadata"][
            "name"
        ]
    )
    ready = pods_ready_false(jobs, name, "MountFailed")
    assert "pod mount-worker-0 (worker 0) waits: MountFailed: FailedMount: " in ready["message"]
    assert 'secret "absent" not found' in ready["message"]  # the kubelet's own words
    said = failed_past_the_timeout(jobs, name, "MountFailed")
    assert 'secret "absent" not found' in said
    keep(f"{ready['message']}\n{said}\n", "start-mount-failed.txt")


def test_an_init_container_that_never_ends_is_named_then_fails_init_timeout(
    jobs: E2eJobs,
) -> None:
    assert jobs.node is not None
    hangs = {"name": "fetch-data", "image": jobs.node.runtime.ref, "command": SLEEP}
    worker = {"initContainers": [hangs], "containers": [{"name": "jaxps"}]}
    name = str(
        jobs.apply(small_job("init", worker=worker, scheduleTimeoutSeconds=TIMEOUT))["metadata"][
            "name"
        ]
    )
    ready = pods_ready_false(jobs, name, "Initializing")
    assert "init container 'fetch-data' has run since" in ready["message"], ready
    said = failed_past_the_timeout(jobs, name, "InitTimeout")
    assert "init container 'fetch-data' has run since" in said
    keep(f"{ready['message']}\n{said}\n", "start-init-timeout.txt")


def test_a_sidecar_listed_first_that_never_exits_keeps_neither_the_job_nor_its_pods(
    jobs: E2eJobs,
) -> None:
    assert jobs.node is not None
    sidecar = {"name": "log-shipper", "image": jobs.node.runtime.ref, "command": SLEEP}
    worker = {"containers": [sidecar, {"name": "jaxps"}]}
    name = str(
        jobs.apply(small_job("sidecar", worker=worker, cleanPodPolicy="All"))["metadata"]["name"]
    )
    pod = wait_for(
        lambda: jobs.pods(name).get(f"{name}-worker-0"), timeout=60, what="the worker's pod"
    )
    first, main = pod["spec"]["containers"]
    assert (first["name"], first["command"]) == ("log-shipper", SLEEP)
    assert "env" not in first  # the sidecar is the user's: nothing of jaxps's in it
    assert main["name"] == "jaxps"
    assert any(e["name"] == "TF_CONFIG" for e in main["env"])
    done = jobs.wait_done(name, timeout=300)  # the jaxps container's end, the sidecar running
    assert done["status"]["state"] == "Succeeded"
    wait_for(lambda: not jobs.pods(name), timeout=120, what=f"every pod of {name} deleted")


def test_someone_elses_pod_with_a_workers_name_fails_the_job_name_taken_and_is_left(
    jobs: E2eJobs,
) -> None:
    assert jobs.node is not None
    theirs = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "taken-worker-0"},
        "spec": {
            "containers": [{"name": "theirs", "image": jobs.node.runtime.ref, "command": SLEEP}]
        },
    }
    before = made(jobs, theirs)
    jobs.apply(small_job("taken"))
    failed = jobs.wait_condition("taken", "Failed", timeout=120)
    assert failed["reason"] == "NameTaken", failed
    assert failed["message"].startswith("Pod taken-worker-0 holds a name this job needs"), failed
    pod = read(jobs, "pod", "taken-worker-0")
    assert pod["metadata"]["uid"] == before["metadata"]["uid"]
    assert "deletionTimestamp" not in pod["metadata"]
    assert "ownerReferences" not in pod["metadata"]


@pytest.mark.parametrize(
    ("how", "reason"), [("deleted", "SecretLost"), ("changed", "SecretChanged")]
)
def test_the_jobs_secret_deleted_or_changed_while_it_runs_fails_it_naming_it(
    jobs: E2eJobs, how: str, reason: str
) -> None:
    body = small_job(f"keys-{how}")
    body["spec"]["training"]["steps"] = 1_000_000
    name = str(jobs.apply(body)["metadata"]["name"])
    jobs.wait_condition(name, "Running", timeout=180)
    uid = str((jobs.get(name) or {})["metadata"]["uid"])[:8]
    secret = f"{name}-tls-{uid}"
    if how == "deleted":
        jobs.kubectl("delete", "secret", secret)
    else:  # what a tool that syncs Secrets might write
        jobs.kubectl("patch", "secret", secret, "--type=merge", "-p", '{"stringData":{"x":"y"}}')
    # noticed within the 30 s the operator trusts what it read (`kube.KEPT_FOR`), then a pass
    failed = jobs.wait_condition(name, "Failed", timeout=120)
    assert failed["reason"] == reason, failed
    assert failed["message"].startswith(f"the job's Secret {secret} (its tasks' TLS"), failed
    wait_for(lambda: not jobs.pods(name), timeout=120, what=f"every pod of {name} deleted")
    secrets = jobs.kubectl("get", "secrets", "-o", "name")
    # no second CA issued beside the pods' own; a changed one is left as it is, with the job
    assert secrets.count(f"{name}-tls") == (0 if how == "deleted" else 1), secrets
