"""Kills by Kubernetes are named: a pod preempted, evicted or on a lost node (its
DisruptionTarget condition) is replaced as Kubernetes' doing, past backoffLimit too; a container
killed for a failing liveness probe says so."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxps_operator import kube
from tests.unit.test_planner import job, pods, step


def _failed(condition: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "tj-worker-1",
            "uid": "p-1",
            "labels": {"jaxps.dev/replica-type": "worker", "jaxps.dev/replica-index": "1"},
            "ownerReferences": [{"uid": "u"}],
        },
        "spec": {"containers": [{"name": "jaxps"}]},
        "status": {
            "phase": "Failed",
            "conditions": [condition] if condition else [],
            "containerStatuses": [
                {"name": "jaxps", "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}
            ],
        },
    }


def test_a_pod_the_scheduler_preempted_carries_kubernetes_reason_and_words() -> None:
    preempted = {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": "PreemptionByScheduler",
        "message": "Preempted in order to admit critical pod",
    }
    state = kube.pod_state(_failed(preempted), "u")
    assert state is not None
    assert state.disruption == "PreemptionByScheduler: Preempted in order to admit critical pod"
    plain = kube.pod_state(_failed(None), "u")
    assert plain is not None
    assert plain.disruption == ""


def test_the_kubelets_last_liveness_failure_is_what_killed_the_container() -> None:
    events = [
        {"reason": "Unhealthy", "message": "Readiness probe failed: x", "lastTimestamp": "3"},
        {"reason": "Unhealthy", "message": "Liveness probe failed: timeout", "lastTimestamp": "2"},
        {
            "reason": "Killing",
            "message": "Container jaxps failed liveness probe, will be restarted",
            "lastTimestamp": "4",
        },
    ]
    assert (
        kube.liveness_kill(events, "p-1") == "LivenessProbeFailed: Liveness probe failed: timeout"
    )
    # a probe that failed under its threshold, then a death of something else: not the probe's
    assert kube.liveness_kill(events[:2], "p-1") == ""


def test_a_disrupted_pod_is_replaced_past_the_backoff_limit_and_the_event_says_why() -> None:
    j = job(ps=1, workers=2, run={"backoffLimit": 0})
    step(j, pods(j))
    ps, worker0, worker1 = pods(j, worker1=("Failed", 137))
    evicted = dataclasses.replace(worker1, disruption="TerminationByKubelet: node low on memory")
    result = step(j, [ps, worker0, evicted])
    assert result.status["state"] != "Failed"
    assert result.delete == [worker1.name]  # replaced once gone
    [event] = [e for e in result.events if e.reason == "PodDisrupted"]
    assert (
        "was ended by Kubernetes (exit code 137): TerminationByKubelet: node low" in event.message
    )


def test_a_liveness_kill_counts_as_a_failure_and_says_so() -> None:
    j = job(ps=1, workers=2, run={"backoffLimit": 0})
    step(j, pods(j))
    ps, worker0, worker1 = pods(j, worker1=("Failed", 137))
    killed = dataclasses.replace(worker1, disruption="LivenessProbeFailed: Liveness probe failed")
    result = step(j, [ps, worker0, killed])
    assert result.status["state"] == "Failed"
    failed = next(c for c in result.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "LivenessProbeFailed: Liveness probe failed" in failed["message"]
