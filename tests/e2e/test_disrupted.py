"""Pods Kubernetes ends itself, on the real node: a pod evicted through the eviction API (what
`kubectl drain` does) is named (PodDisrupted, Kubernetes' reason) and replaced, never counted
against backoffLimit; a lost node (its kubelet stopped, the job's processes gone with the
machine) leaves its pods Running in the API for ever, and the job says so, takes them for lost
past `runPolicy.nodeLostSeconds`, waits for a node, and resumes from its checkpoint once the
node is back."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
from kubernetes import client

from tests.cluster.harness import ROOT, wait_for
from tests.e2e.harness import E2eJobs, keep, phase
from tests.e2e.test_training import EVERY, start, summary, training_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
STEPS = 1200  # past the first checkpoint (EVERY) with room to go on: nothing compares accuracy


def reasons(jobs: E2eJobs, name: str, reason: str) -> list[str]:
    return [e["message"] for e in jobs.events(name) if e["reason"] == reason]


def pods_ready(jobs: E2eJobs, name: str, reason: str) -> dict[str, Any] | None:
    for c in ((jobs.get(name) or {}).get("status") or {}).get("conditions") or []:
        if (c["type"], c["status"], c.get("reason")) == ("PodsReady", "False", reason):
            return dict(c)
    return None


def test_a_pod_evicted_through_the_eviction_api_is_named_and_replaced_past_backoff_limit(
    jobs: E2eJobs,
) -> None:
    body = training_job("evicted", steps=STEPS)
    body["spec"]["runPolicy"] = {"backoffLimit": 0}  # an eviction is not the job's failure
    name = start(jobs, body)
    jobs.wait_progress(name, "lastCheckpointStep", EVERY)
    victim = jobs.running_pod(name, f"{name}-worker-1")
    jobs.cluster.core.create_namespaced_pod_eviction(
        f"{name}-worker-1",
        jobs.namespace,
        client.V1Eviction(
            metadata=client.V1ObjectMeta(name=f"{name}-worker-1", namespace=jobs.namespace)
        ),
    )
    said = wait_for(
        lambda: reasons(jobs, name, "PodDisrupted"),
        timeout=60,
        what=f"a PodDisrupted Event on {name}",
    )
    assert len(said) == 1, said
    assert f"worker 1 (pod {name}-worker-1) was ended by Kubernetes" in said[0], said
    assert "EvictionByEvictionAPI" in said[0], said
    job = jobs.wait_done(name)
    assert job["status"]["restarts"] == 1, jobs.story(name)
    assert job["status"]["progress"]["step"] == STEPS
    replaced = jobs.pod(f"{name}-worker-1")
    assert replaced["metadata"]["uid"] != victim["metadata"]["uid"]
    keep("\n".join(said), "evicted-worker.txt")


def kubelet(jobs: E2eJobs, action: str) -> None:
    assert jobs.node is not None
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "hack" / "node.py"),
            f"kubelet-{action}",
            "--dir",
            str(jobs.node.state),
        ],
        check=True,
        timeout=180,
    )
    phase(f"kubelet {action}")


LOST_AFTER = 5  # runPolicy.nodeLostSeconds


@pytest.mark.exclusive  # the node's kubelet stops: every other job on it would wait too
def test_a_lost_nodes_pods_are_taken_for_lost_and_the_job_resumes_once_a_node_is_back(
    jobs: E2eJobs,
) -> None:
    node = jobs.node
    assert node is not None
    body = training_job("lostnode", steps=STEPS)
    body["spec"]["runPolicy"] = {"nodeLostSeconds": LOST_AFTER, "backoffLimit": 0}
    name = start(jobs, body)
    jobs.wait_progress(name, "lastCheckpointStep", EVERY)
    before = {n: jobs.running_pod(name, n) for n in sorted(jobs.pods(name))}
    lines: list[str] = []
    began = time.monotonic()

    def note(line: str) -> None:
        lines.append(f"{time.monotonic() - began:6.1f} s  {line}")
        phase(f"lost node: {line}")

    kubelet(jobs, "stop")
    try:
        for pod in before.values():  # the machine went with its processes
            node.kill(pod)
        note(f"kubelet stopped, the processes of {', '.join(before)} killed")
        said = wait_for(
            lambda: pods_ready(jobs, name, "NodeNotReady"),
            timeout=120,
            what=f"PodsReady False NodeNotReady on {name}",
        )
        note(f"PodsReady NodeNotReady: {said['message']}")
        assert "NotReady since" in said["message"], said
        lost = wait_for(
            lambda: (
                reasons(jobs, name, "NodeLost")
                if len(reasons(jobs, name, "NodeLost")) >= len(before)
                else None
            ),
            timeout=60,
            what=f"a NodeLost Event for each pod of {name}",
        )
        note(f"NodeLost: {lost[0]}")
        assert f"past runPolicy.nodeLostSeconds ({LOST_AFTER} s)" in lost[0], lost
        # their replacements wait for a node that can take them, and the job says why
        waiting = wait_for(
            lambda: pods_ready(jobs, name, "Unschedulable"),
            timeout=60,
            what=f"PodsReady False Unschedulable on {name}",
        )
        note(f"PodsReady Unschedulable: {waiting['message']}")
        replaced = jobs.pods(name)
        assert set(replaced) == set(before), replaced
        for n, pod in replaced.items():
            assert pod["metadata"]["uid"] != before[n]["metadata"]["uid"], n
            assert pod["status"].get("phase") == "Pending", pod["status"]
    finally:
        kubelet(jobs, "start")
    note("kubelet started again")
    job = jobs.wait_done(name)
    note(f"Succeeded at step {job['status']['progress']['step']}")
    assert job["status"]["progress"]["step"] == STEPS
    assert job["status"]["restarts"] == len(before), jobs.story(name)  # each once, none failed
    done = summary(jobs, f"{name}-worker-0")
    assert done["startedFrom"]["step"] >= EVERY, done["startedFrom"]  # from its checkpoint
    note(f"the chief started from step {done['startedFrom']['step']}")
    keep("\n".join(lines), "lost-node.txt")
