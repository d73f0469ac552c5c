"""TrainingJobs on a real node: the runtime in containers, the operator in-cluster.

Each test gets its own namespace; kill tests SIGKILL the container's process on the node, as a
crash or the OOM killer would, and the job must still succeed with an undisturbed run's
accuracy.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.harness import ROOT, binaries, wait_for
from tests.e2e.harness import (
    RELEASE_NAMESPACE,
    SHARED,
    E2eJobs,
    Installed,
    chief_step,
    keep,
    manifest,
    metric,
    namespace,
    phase,
    recovered,
    turn,
)
from tests.process.test_datasets import learnable_mnist

# a test's time includes its share of the tier's set-up (images, node, chart)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Long enough to kill a task between two checkpoints and see training resume; short enough for
# a 2-core machine. Sync, so a dead ps stops every step until it is back and rolled back.
STEPS, EVERY = 2000, 200
# A disturbed run may lose a little to a rollback; more than this is a real difference.
ACCURACY_SLACK = 0.03


def training_job(name: str, *, chief: bool = False, steps: int = STEPS) -> dict[str, Any]:
    replicas: dict[str, Any] = {"ps": {"replicas": 2}, "worker": {"replicas": 2}}
    if chief:
        replicas["chief"] = {"replicas": 1}
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": replicas,
            "training": {
                "model": {"name": "mlp", "kwargs": {"hidden": [64]}},
                "dataset": {"name": "digits"},
                "mode": "sync",
                "steps": steps,
                "batchSize": 32,
                "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
                "checkpoint": {
                    "dir": "/checkpoints",
                    "claimName": f"{name}-checkpoints",
                    "everySteps": EVERY,
                    "keep": 3,
                },
                "heartbeatSeconds": 0.5,
                "logEverySeconds": 2,
            },
        },
    }


def start(jobs: E2eJobs, body: dict[str, Any]) -> str:
    name = str(body["metadata"]["name"])
    jobs.checkpoint_claim(f"{name}-checkpoints")
    jobs.apply(body)
    return name


def accuracy(job: dict[str, Any]) -> float:
    evaluation = job["status"]["progress"].get("eval") or {}
    assert "accuracy" in evaluation, f"no eval accuracy in {job['status']['progress']}"
    return float(evaluation["accuracy"])


def summary(jobs: E2eJobs, pod: str) -> dict[str, Any]:
    """The chief's final JSON, as Kubernetes kept it: its container's termination message."""
    terminated = jobs.pod(pod)["status"]["containerStatuses"][0]["state"].get("terminated") or {}
    assert terminated.get("message"), f"pod {pod} ended without a termination message"
    return dict(json.loads(terminated["message"]))


def no_pod_left_running(jobs: E2eJobs, name: str) -> None:
    wait_for(
        lambda: all(
            p["status"].get("phase") not in ("Pending", "Running") for p in jobs.pods(name).values()
        ),
        timeout=60,
        what=f"no pod of {name} pending or running",
    )


def test_the_chart_runs_the_operator_in_cluster(installed: Installed) -> None:
    pod = installed.ready_pod()
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "jaxps"
    container = spec["containers"][0]
    assert container["image"] == installed.node.operator.ref
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # the in-cluster operator reached the API server through the `kubernetes` Service
    assert "jaxps_operator" in installed.metrics()
    # and the kubelet's probe passes: the container is never restarted for liveness
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


@pytest.fixture(scope="module")
def undisturbed(installed: Installed) -> float:
    """The accuracy of the kill tests' job when nothing is killed: run once per node, by the
    first worker that needs it (the others wait for it, under a lock in the node's state, and
    read what it found), not once per worker."""
    state = os.environ.get(SHARED)
    if state is None:  # one process: once per module anyway
        return _undisturbed(installed)
    found = Path(state) / "undisturbed.json"
    with open(Path(state) / "undisturbed.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not found.exists():
            with turn(exclusive=False):  # never beside a test that stops what every job needs
                found.write_text(json.dumps(_undisturbed(installed)))
    return float(json.loads(found.read_text()))


def _undisturbed(installed: Installed) -> float:
    with namespace(installed) as jobs:
        name = start(jobs, training_job("calm"))
        job = jobs.wait_done(name)
    phase(
        f"undisturbed run: accuracy {accuracy(job):.4f}, step {job['status']['progress']['step']}"
    )
    return accuracy(job)


def test_the_mnist_example_trains_to_succeeded(jobs: E2eJobs) -> None:
    body = manifest(ROOT / "examples" / "mnist.yaml")
    jobs.checkpoint_claim(body["spec"]["training"]["checkpoint"]["claimName"])
    jobs.kubectl("apply", "-f", str(ROOT / "examples" / "mnist.yaml"))
    started = time.monotonic()
    job = jobs.wait_done("mnist")
    phase(f"mnist: Succeeded {time.monotonic() - started:.0f} s after apply")
    progress = job["status"]["progress"]
    assert progress["step"] == body["spec"]["training"]["steps"]
    assert accuracy(job) >= 0.9
    assert progress["lastCheckpointStep"] == body["spec"]["training"]["steps"]
    no_pod_left_running(jobs, "mnist")
    # worker-1, told to stop, ended on its own within the operator's grace (cleanPodPolicy
    # Running deletes a succeeded job's pods only once they have had that long): its log stays
    worker = jobs.pods("mnist").get("mnist-worker-1")
    assert worker is not None, "mnist-worker-1 was deleted before it ended: its log is gone"
    assert worker["status"]["phase"] == "Succeeded", worker["status"]
    # the workers read and pushed over the bulk path, mutual TLS between pods (`bulk`)
    logs = jobs.kubectl("logs", "mnist-worker-1")
    served = re.search(r"(\d+) of (\d+) reads and updates went on the bulk path", logs)
    assert served, f"worker-1 did not say how its calls went: {logs[-2000:]}"
    assert int(served.group(1)) == int(served.group(2)) > 0, served.group(0)
    shown = jobs.kubectl("get", "tj", "mnist", "-o", "jsonpath={.status.progress}")
    assert json.loads(shown)["eval"]["accuracy"] == progress["eval"]["accuracy"]
    keep(
        f"{jobs.kubectl('get', 'tj,pods', '-o', 'wide')}\n.status.progress: {shown}\n", "mnist.txt"
    )


def test_the_mnist_example_reads_idx_files_from_a_volume_every_pod_mounts(jobs: E2eJobs) -> None:
    body = manifest(ROOT / "examples" / "mnist.yaml")
    name = body["metadata"]["name"] = "mnist-files"
    body["spec"]["training"]["checkpoint"]["claimName"] = f"{name}-checkpoints"
    checkpoints = jobs.checkpoint_claim(f"{name}-checkpoints")
    data = learnable_mnist(jobs.checkpoint_claim(f"{name}-data"))
    for file in data.iterdir():
        file.chmod(0o644)  # the runtime runs as an unprivileged user
    mount = {
        "spec": {
            "volumes": [
                {
                    "name": "mnist",
                    "persistentVolumeClaim": {"claimName": f"{name}-data", "readOnly": True},
                }
            ],
            "containers": [
                {
                    "name": "jaxps",
                    "volumeMounts": [
                        {"name": "mnist", "mountPath": "/data/mnist", "readOnly": True}
                    ],
                }
            ],
        }
    }
    for replica in body["spec"]["replicaSpecs"].values():
        replica["template"] = mount
    jobs.apply(body)
    job = jobs.wait_done(name)
    assert accuracy(job) >= 0.9, job["status"]
    # the example's relative dir (data/mnist) is /data/mnist in a pod: the files were read, so
    # the MLP took the images' 784 inputs (not the fallback digits' 64)
    [latest] = sorted(checkpoints.glob("manifest-*.json"))[-1:]
    shapes = {
        v["name"]: v["shape"] for v in json.loads(latest.read_text())["placement"]["variables"]
    }
    assert shapes["['hidden_0']['kernel']"] == [784, 64]
    logs = jobs.kubectl("logs", f"{name}-worker-0")
    assert "training on the built-in" not in logs


def kubectl_jaxps(jobs: E2eJobs, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl jaxps ARGS`: kubectl finds `kubectl-jaxps` on PATH and runs it with ARGS."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(
        [
            str(binaries() / "kubectl"),
            "jaxps",
            *args,
            "-n",
            jobs.namespace,
            "--kubeconfig",
            str(jobs.cluster.kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


def test_the_sdk_example_runs_mnist_on_the_cluster_and_kubectl_jaxps_reads_it(
    jobs: E2eJobs,
) -> None:
    body = manifest(ROOT / "examples" / "mnist.yaml")
    jobs.checkpoint_claim(body["spec"]["training"]["checkpoint"]["claimName"])
    command = [
        sys.executable,
        str(ROOT / "examples" / "sdk_mnist.py"),
        "--kubernetes",
        "-n",
        jobs.namespace,
        "--kubeconfig",
        str(jobs.cluster.kubeconfig),
        "--keep",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{jobs.story('mnist')}"
    assert "mnist: Succeeded after 600 steps" in done.stdout
    logs = kubectl_jaxps(jobs, "logs", "mnist", "worker-0")
    assert logs.returncode == 0, logs.stderr
    assert "done: step 600" in logs.stdout
    described = kubectl_jaxps(jobs, "describe", "mnist")
    assert described.returncode == 0, described.stderr
    assert "Succeeded" in described.stdout
    assert "JobSucceeded" in described.stdout
    deleted = kubectl_jaxps(jobs, "delete", "mnist")
    assert deleted.returncode == 0, deleted.stderr
    assert jobs.get("mnist") is None
    keep(
        f"$ python examples/sdk_mnist.py --kubernetes -n {jobs.namespace} --keep\n{done.stdout}"
        f"\n$ kubectl jaxps describe mnist\n{described.stdout}"
        f"\n$ kubectl jaxps delete mnist\n{deleted.stdout}",
        "sdk-kubernetes.txt",
    )


def test_a_misspelt_training_fails_at_once_with_no_pod(jobs: E2eJobs) -> None:
    body = training_job("typo", steps=100)
    body["spec"]["training"]["model"] = {"name": "resnet"}
    body["spec"]["training"]["optimizer"] = {"name": "sgdd"}
    name = start(jobs, body)
    failed = jobs.wait_condition(name, "Failed", timeout=60)
    assert failed["reason"] == "InvalidTraining"
    assert "spec.training.model.name" in failed["message"]
    assert "spec.training.optimizer.name" in failed["message"]
    assert jobs.pods(name) == {}
    assert jobs.get(name)["status"]["restarts"] == 0  # type: ignore[index]
    keep(f"{failed['reason']}: {failed['message']}\n", "invalid-training.txt")


def test_a_task_refusing_its_training_fails_the_job_once_with_its_words(jobs: E2eJobs) -> None:
    body = training_job("nomodule", steps=100)
    # well-formed, so only a task can find that it cannot be imported
    body["spec"]["training"]["model"] = {"module": "nowhere:make_model"}
    name = start(jobs, body)
    failed = jobs.wait_condition(name, "Failed", timeout=180)
    assert failed["reason"] == "InvalidTraining"
    assert "nowhere" in failed["message"]
    assert "exit code 78" in failed["message"]
    assert jobs.get(name)["status"]["restarts"] == 0  # type: ignore[index]
    no_pod_left_running(jobs, name)
    keep(f"{failed['reason']}: {failed['message']}\n", "task-invalid-training.txt")


def kill_and_recover(
    jobs: E2eJobs, name: str, victim: str, *, watch: str, rollback: bool
) -> dict[str, Any]:
    """Kills `victim` after the first checkpoint; returns the job once it succeeded and the
    seconds from the kill to the next global step, read from `watch`'s metrics. With
    `rollback`, `watch` is the chief: its next step past the step its recovery went on from
    (`jaxps_recoveries_total`, `jaxps_recovered_to_step`), as a ps killed just after a
    checkpoint rolls back to the step it was at, with no dip to see."""
    node = jobs.node
    assert node is not None
    jobs.wait_progress(name, "lastCheckpointStep", EVERY)
    # every pod is Ready: the kubelet's probes reached them over plain HTTP, with no certificate
    wait_for(
        lambda: pods_ready(jobs.get(name)),
        timeout=120,
        what=f"condition PodsReady on {name}",
    )
    top = kubectl_jaxps(jobs, "top", name, "--once", "--interval", "3")
    assert top.returncode == 0, top.stderr
    rows = {line.split()[0]: line.split() for line in top.stdout.splitlines() if "Running" in line}
    assert set(rows) >= {"ps-0", "ps-1", "worker-0", "worker-1"}, top.stdout
    assert rows["worker-0"][2].isdigit(), top.stdout  # the chief's step, read through the proxy
    keep(f"$ kubectl jaxps top {name} --once\n{top.stdout}", f"top-{victim}.txt")
    pod = jobs.running_pod(name, f"{name}-{victim}")
    watched = jobs.running_pod(name, f"{name}-{watch}")
    before = chief_step(watched) or 0
    killed = node.kill(pod)
    lowest: int | None = None if rollback else before
    # The job trains on while the kill is being done (finding the process takes a moment), so
    # the step it was killed at is the highest seen until its recovery is reported.
    at_kill = before
    recovered = None
    deadline = time.monotonic() + 240
    while recovered is None and time.monotonic() < deadline:
        if lowest is None and (metric(watched, "jaxps_recoveries_total") or 0) >= 1:
            lowest = int(metric(watched, "jaxps_recovered_to_step") or 0)
        step = chief_step(watched)
        if lowest is None and step is not None:
            at_kill = max(at_kill, step)
        if lowest is not None and step is not None and step > lowest:
            recovered = time.monotonic() - killed
        time.sleep(0.02)
    old = pod["metadata"]["uid"]
    replacement = wait_for(
        lambda: (p := jobs.pods(name).get(pod["metadata"]["name"])) and p["metadata"]["uid"] != old,
        timeout=120,
        what=f"a replacement of pod {pod['metadata']['name']}",
    )
    assert replacement
    story = "\n".join(
        [
            f"$ kubectl get tj,pods -o wide   # after SIGKILL of {victim}",
            jobs.kubectl("get", "tj,pods", "-o", "wide"),
            f"$ kubectl describe tj {name}",
            jobs.kubectl("describe", "tj", name),
        ]
    )
    job = jobs.wait_done(name)
    status = job["status"]
    role = victim.rsplit("-", 1)[0]
    assert status["restarts"] >= 1
    assert status["replicaStatuses"][role]["restarts"] >= 1
    jobs.wait_event(
        name, "PodReplaced", f"(pod {pod['metadata']['name']}) failed with exit code 137"
    )
    back = f" (rolled back to {lowest})" if rollback else ""
    line = f"{victim} killed at step {before} (up to {at_kill} while the kill was done): " + (
        f"next global step {recovered:.2f} s after SIGKILL{back}"
        if recovered is not None
        else "the next step was not seen on the metrics"
    )
    phase(line)
    keep(f"{line}\n\n{story}\n", f"kill-{victim}.txt")
    return {
        "job": job,
        "recovered": recovered,
        "before": before,
        "at_kill": at_kill,
        "lowest": lowest,
    }


def pods_ready(job: dict[str, Any] | None) -> bool:
    conditions = ((job or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "PodsReady" and c["status"] == "True" for c in conditions)


def test_a_killed_ps_is_replaced_and_every_ps_rolls_back_to_the_checkpoint(
    jobs: E2eJobs, undisturbed: float
) -> None:
    name = start(jobs, training_job("killps"))
    out = kill_and_recover(jobs, name, "ps-0", watch="worker-0", rollback=True)
    assert out["recovered"] is not None, "training did not step again after the ps came back"
    assert out["lowest"] % EVERY == 0
    assert out["lowest"] <= out["at_kill"]  # back to a checkpoint, never ahead
    done = summary(jobs, f"{name}-worker-0")
    assert done["recoveries"], "the chief recorded no recovery"
    assert all(r["toStep"] % EVERY == 0 for r in done["recoveries"])
    assert accuracy(out["job"]) >= undisturbed - ACCURACY_SLACK


def test_a_killed_ps_process_is_taken_over_in_its_pod_by_the_keepers_standby(
    jobs: E2eJobs, undisturbed: float
) -> None:
    node = jobs.node
    assert node is not None
    name = start(jobs, training_job("takeover"))
    jobs.wait_progress(name, "lastCheckpointStep", EVERY)
    pod = jobs.running_pod(name, f"{name}-ps-0")
    chief = jobs.running_pod(name, f"{name}-worker-0")
    ps = node.ps_process(pod)
    before = chief_step(chief) or 0
    os.kill(ps, signal.SIGKILL)
    seconds = recovered(chief, recoveries=0, killed=time.monotonic())
    job = jobs.wait_done(name)
    assert job["status"]["restarts"] == 0, jobs.story(name)  # no pod was replaced
    assert jobs.pod(f"{name}-ps-0")["metadata"]["uid"] == pod["metadata"]["uid"]
    done = summary(jobs, f"{name}-worker-0")
    assert len(done["recoveries"]) == 1, done["recoveries"]
    logs = jobs.kubectl("logs", f"{name}-ps-0")
    assert "keeper: ps killed (signal 9); the standby took over" in logs
    assert accuracy(job) >= undisturbed - ACCURACY_SLACK
    line = f"ps-0's ps process killed at step {before}: next global step {seconds:.2f} s later"
    phase(line)
    keep(
        f"{line}\n\n$ kubectl logs {name}-ps-0 | grep keeper\n"
        + "\n".join(x for x in logs.splitlines() if "keeper" in x),
        "takeover-ps-0.txt",
    )


def test_a_killed_worker_is_replaced_and_training_goes_on(
    jobs: E2eJobs, undisturbed: float
) -> None:
    name = start(jobs, training_job("killworker"))
    out = kill_and_recover(jobs, name, "worker-1", watch="worker-0", rollback=False)
    assert out["job"]["status"]["progress"]["step"] == STEPS
    assert accuracy(out["job"]) >= undisturbed - ACCURACY_SLACK


def test_a_killed_chief_is_replaced_and_adopts_the_live_ps(
    jobs: E2eJobs, undisturbed: float
) -> None:
    name = start(jobs, training_job("killchief", chief=True))
    out = kill_and_recover(jobs, name, "chief-0", watch="worker-0", rollback=False)
    done = summary(jobs, f"{name}-chief-0")
    assert done["startedFrom"]["step"] > 0, f"the new chief started over: {done['startedFrom']}"
    assert out["job"]["status"]["progress"]["step"] == STEPS
    assert accuracy(out["job"]) >= undisturbed - ACCURACY_SLACK


def test_a_task_that_fails_for_good_fails_the_job_naming_it(jobs: E2eJobs) -> None:
    body = training_job("broken", steps=100)
    body["spec"]["replicaSpecs"]["worker"] = {
        "replicas": 2,
        "restartPolicy": "ExitCode",
        "template": {
            "spec": {
                "containers": [
                    {"name": "jaxps", "command": ["python", "-c", "raise SystemExit(3)"]}
                ]
            }
        },
    }
    name = start(jobs, body)
    failed = jobs.wait_condition(name, "Failed", timeout=180)
    assert failed["reason"] == "ReplicaFailed"
    assert "worker" in failed["message"]
    assert "exit code 3" in failed["message"]
    no_pod_left_running(jobs, name)
    assert jobs.get(name)["status"]["restarts"] == 0  # type: ignore[index]


def test_suspend_deletes_the_pods_and_resume_restarts_from_the_checkpoint(jobs: E2eJobs) -> None:
    name = start(jobs, training_job("pause"))
    checkpoint = jobs.wait_progress(name, "lastCheckpointStep", EVERY)
    jobs.patch_spec(name, {"runPolicy": {"suspend": True}})
    jobs.wait_condition(name, "Suspended", timeout=60)
    wait_for(lambda: not jobs.pods(name), timeout=90, what=f"every pod of {name} deleted")
    jobs.patch_spec(name, {"runPolicy": {"suspend": False}})
    job = jobs.wait_done(name)
    done = summary(jobs, f"{name}-worker-0")
    assert done["startedFrom"]["how"] == "restored"
    assert done["startedFrom"]["step"] >= checkpoint
    assert job["status"]["progress"]["step"] == STEPS


@pytest.mark.exclusive  # the operator of every job is deleted
def test_a_deleted_operator_pod_is_replaced_and_carries_on_without_duplicates(
    jobs: E2eJobs, installed: Installed
) -> None:
    name = start(jobs, training_job("orphan"))
    jobs.wait_progress(name, "step", 100)
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(p["metadata"]["uid"] for p in jobs.pods(name).values())
            stop.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    old = installed.ready_pod()
    jobs.cluster.kubectl(
        "delete", "pod", "-n", RELEASE_NAMESPACE, old["metadata"]["name"], "--wait=false"
    )
    new = wait_for(
        lambda: (p := installed.pod()) and p["metadata"]["uid"] != old["metadata"]["uid"] and p,
        timeout=120,
        what="a new operator pod",
    )
    assert new
    installed.ready_pod()
    job = jobs.wait_done(name)
    stop.set()
    watcher.join()
    assert len(seen) == 4, f"pods were created more than once: {len(seen)} uids for 4 tasks"
    assert job["status"]["restarts"] == 0


# The kernel's OOM killer ends a container past its memory limit on this node (cgroup v1, the
# kubelet's cgroupfs driver): importing JAX in the runtime image peaks at about 80 MB (measured
# on the node: 40Mi to 72Mi were all OOMKilled within 2 s of the start, 80Mi was not), so this
# is far below what a task needs and the worker dies while it starts, every time.
TOO_LITTLE_MEMORY = "50Mi"


def starved_worker(name: str, *, restart_policy: str, backoff_limit: int) -> dict[str, Any]:
    """One ps and one worker whose template gives it `TOO_LITTLE_MEMORY`."""
    body = training_job(name, steps=100)
    memory = {"memory": TOO_LITTLE_MEMORY}
    body["spec"]["replicaSpecs"] = {
        "ps": {"replicas": 1},
        "worker": {
            "replicas": 1,
            "restartPolicy": restart_policy,
            "template": {
                "spec": {
                    "containers": [
                        {"name": "jaxps", "resources": {"limits": memory, "requests": memory}}
                    ]
                }
            },
        },
    }
    body["spec"]["runPolicy"] = {"backoffLimit": backoff_limit}
    return body


@pytest.mark.parametrize(
    ("restart_policy", "backoff_limit", "ending", "replaced"),
    [
        pytest.param("Never", 6, "; its restartPolicy is Never", 0, id="restartPolicy-Never"),
        pytest.param(
            "OnFailure",
            1,
            "; 1 pod replacement reached runPolicy.backoffLimit (1)",
            1,
            id="OnFailure-past-backoffLimit-1",
        ),
    ],
)
def test_a_worker_the_kernel_oom_kills_fails_the_job_naming_its_memory_limit_and_the_field(
    jobs: E2eJobs, restart_policy: str, backoff_limit: int, ending: str, replaced: int
) -> None:
    name = start(
        jobs,
        starved_worker(
            f"oom-{restart_policy.lower()}",
            restart_policy=restart_policy,
            backoff_limit=backoff_limit,
        ),
    )
    pod = f"{name}-worker-0"
    failed = jobs.wait_condition(name, "Failed", timeout=240)
    # the kernel really killed it for memory: the kubelet says so in the pod's status
    status = jobs.pod(pod)["status"]
    terminated = status["containerStatuses"][0]["state"].get("terminated") or {}
    assert (terminated.get("reason"), terminated.get("exitCode")) == ("OOMKilled", 137), status
    field = "spec.replicaSpecs.worker.template.spec.containers[0].resources.limits.memory"
    assert failed["reason"] == "OOMKilled", failed
    assert failed["message"] == (
        f"worker 0 (pod {pod}) was OOMKilled (exit code 137) with its memory limit "
        f"{TOO_LITTLE_MEMORY}; give worker more memory in {field} of TrainingJob {name}{ending}"
    )
    warnings = jobs.wait_event(name, "OOMKilled", failed["message"])
    assert all(e["type"] == "Warning" for e in warnings), warnings
    job = jobs.get(name)
    assert job is not None
    assert job["status"]["restarts"] == replaced
    if replaced:
        [event] = jobs.wait_event(name, "PodReplaced", pod)
        assert event["type"] == "Warning"
        assert event["message"] == (
            f"worker 0 (pod {pod}) was OOMKilled (exit code 137, memory limit "
            f"{TOO_LITTLE_MEMORY}); replacing it (restartPolicy {restart_policy})"
        )
    else:
        assert not [e for e in jobs.events(name) if e["reason"] == "PodReplaced"]
    no_pod_left_running(jobs, name)  # the ps too (cleanPodPolicy Running)
    keep(
        f"{failed['reason']}: {failed['message']}\n\n$ kubectl get pod {pod} -o jsonpath="
        f"'{{.status.containerStatuses[0].state}}'\n{json.dumps(terminated)}\n\n"
        f"{jobs.kubectl('describe', 'tj', name)}",
        f"oom-{restart_policy.lower()}.txt",
    )


def test_an_oom_policy_raises_the_starved_workers_memory_until_the_job_succeeds(
    jobs: E2eJobs,
) -> None:
    """runPolicy.oomPolicy x4 up to 1Gi: 50Mi -> 200Mi (still killed while it imports JAX, or
    while it trains) -> 800Mi, each raise an Event, and the job trains to Succeeded."""
    body = starved_worker("oom-raised", restart_policy="Never", backoff_limit=6)
    body["spec"]["runPolicy"]["oomPolicy"] = {"factor": 4, "maxMemory": "1Gi"}
    name = start(jobs, body)
    done = jobs.wait_done(name)
    raised = done["status"]["memory"]["worker"]
    assert raised in ("200Mi", "800Mi", "1Gi"), done["status"]
    events = jobs.wait_event(name, "MemoryRaised", f"raised to {raised}")
    assert all(e["type"] == "Warning" for e in events), events
    assert any(
        f"was OOMKilled (exit code 137, memory limit {TOO_LITTLE_MEMORY}); replacing it with "
        "worker's memory limit raised to 200Mi (runPolicy.oomPolicy: x4, at most 1Gi)"
        in e["message"]
        for e in jobs.events(name)
    ), jobs.events(name)
    assert done["status"]["restarts"] == len(
        [e for e in jobs.events(name) if e["reason"] == "MemoryRaised"]
    )
    keep(
        "\n".join(e["message"] for e in jobs.events(name) if e["reason"] == "MemoryRaised"),
        "oom-raised.txt",
    )


def scheduler_events(jobs: E2eJobs) -> list[str]:
    """What the scheduler said of this namespace's pods (FailedScheduling Events outlive the
    pods they name)."""
    items = jobs.cluster.core.list_namespaced_event(
        jobs.namespace, field_selector="reason=FailedScheduling"
    ).items
    return [str(e.message) for e in items]


def test_a_missing_checkpoint_claim_is_named_while_the_pods_wait_then_fails_the_job(
    jobs: E2eJobs,
) -> None:
    body = training_job("noclaim", steps=100)
    body["spec"]["runPolicy"] = {"scheduleTimeoutSeconds": 20}
    claim = body["spec"]["training"]["checkpoint"]["claimName"]
    name = str(jobs.apply(body)["metadata"]["name"])  # and no claim of that name
    missing = f'persistentvolumeclaim "{claim}" not found'

    def pods_ready_names_the_claim() -> dict[str, Any] | None:
        conditions = ((jobs.get(name) or {}).get("status") or {}).get("conditions") or []
        for c in conditions:
            if c["type"] == "PodsReady" and c["status"] == "False" and missing in c["message"]:
                return dict(c)
        return None

    ready = wait_for(
        pods_ready_names_the_claim, timeout=120, what=f"PodsReady False on {name} naming {claim}"
    )
    assert ready["reason"] == "Unschedulable", ready
    assert re.fullmatch(rf"pod {name}-\w+-\d \(\w+ \d\) waits: Unschedulable: .+", ready["message"])
    # the scheduler's own words, as it told the pod
    said = wait_for(
        lambda: [m for m in scheduler_events(jobs) if missing in m],
        what=f"the scheduler's FailedScheduling Event naming {claim}",
    )
    assert any(m in ready["message"] for m in said), (said, ready["message"])
    failed = jobs.wait_condition(name, "Failed", timeout=180)
    assert failed["reason"] == "Unschedulable", failed
    waited = re.fullmatch(
        rf"pod {name}-\w+-\d \(\w+ \d\) waited (\d+) s, past runPolicy.scheduleTimeoutSeconds "
        r"\(20 s\): Unschedulable: (.+)",
        failed["message"],
    )
    assert waited, failed["message"]
    assert int(waited.group(1)) >= 20
    assert missing in waited.group(2)
    # a Warning while the pods waited (the claim named), and one when the job failed
    warnings = jobs.wait_event(name, "Unschedulable", failed["message"])
    assert all(e["type"] == "Warning" for e in warnings), warnings
    assert any(" waits: " in e["message"] and missing in e["message"] for e in warnings), warnings
    # cleanPodPolicy Running: the pods that waited are deleted
    wait_for(lambda: not jobs.pods(name), timeout=120, what=f"every pod of {name} deleted")
    keep(
        f"while waiting, PodsReady False {ready['reason']}: {ready['message']}\n"
        f"then Failed {failed['reason']}: {failed['message']}\n\n"
        f"{jobs.kubectl('describe', 'tj', name)}",
        "missing-claim.txt",
    )
