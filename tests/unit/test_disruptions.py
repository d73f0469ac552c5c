"""Kills by Kubernetes are named: a pod preempted, evicted or on a lost node (its
DisruptionTarget condition) is replaced as Kubernetes' doing, past backoffLimit too; a container
killed for a failing liveness probe says so."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from jaxps_operator import builders, kube
from jaxps_operator.kubeclient import ApiError
from jaxps_operator.objects import PodState
from jaxps_operator.policy import node as node_policy
from tests.unit.test_planner import NOW, cond, job, pods, step


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


def _lost(state: PodState, since: datetime) -> PodState:
    return dataclasses.replace(
        state,
        ready=False,
        node="node-a",
        node_lost="Ready=Unknown NodeStatusUnknown: Kubelet stopped posting node status.",
        node_lost_since=since,
    )


def test_a_pod_whose_node_is_not_ready_is_said_then_deleted_at_once_past_node_lost_seconds() -> (
    None
):
    j = job(ps=1, workers=2, run={"backoffLimit": 0, "nodeLostSeconds": 30})
    step(j, pods(j))
    ps, worker0, worker1 = pods(j)
    down = _lost(worker1, NOW - timedelta(seconds=10))
    waiting = step(j, [ps, worker0, down])
    ready = cond(waiting.status, "PodsReady")
    assert ready is not None
    assert ready["status"] == "False"
    assert ready["reason"] == "NodeNotReady"
    assert "pod tj-worker-1 (worker 1) is on node node-a, NotReady since" in ready["message"]
    assert "Kubelet stopped posting node status" in ready["message"]
    assert waiting.delete == []
    assert waiting.force == []
    assert waiting.requeue_after is not None
    assert waiting.requeue_after <= 20
    assert [e.reason for e in waiting.events] == ["NodeNotReady"]
    # the same again: no second Event
    assert [e.reason for e in step(j, [ps, worker0, down]).events] == []
    lost = step(j, [ps, worker0, down], now=NOW + timedelta(seconds=21))
    assert lost.delete == [worker1.name]
    assert lost.force == [worker1.name]
    assert lost.status["state"] != "Failed"  # Kubernetes' doing: not against backoffLimit 0
    assert lost.status["restarts"] == 1
    [event] = [e for e in lost.events if e.reason == "NodeLost"]
    assert "past runPolicy.nodeLostSeconds (30 s)" in event.message
    assert "node node-a" in event.message
    # gone: its replacement is created, nothing counted twice
    again = step(j, [ps, worker0], now=NOW + timedelta(seconds=22))
    assert [m["metadata"]["name"] for m in again.create if m["kind"] == "Pod"] == [worker1.name]
    assert again.status["restarts"] == 1


def test_a_terminating_pod_on_a_lost_node_is_deleted_at_once_and_not_counted_again() -> None:
    j = job(ps=1, workers=2)
    step(j, pods(j))
    ps, worker0, worker1 = pods(j)
    stuck = dataclasses.replace(
        _lost(worker1, NOW - timedelta(seconds=61)), deleting=True
    )  # the default nodeLostSeconds: 60
    result = step(j, [ps, worker0, stuck])
    assert result.force == [worker1.name]
    assert result.status["restarts"] == 0


def test_a_pod_on_a_ready_node_is_left_alone() -> None:
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert kube._not_ready(ready) is None
    unknown = {
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "Unknown",
                    "reason": "NodeStatusUnknown",
                    "message": "Kubelet stopped posting node status.",
                    "lastTransitionTime": "2026-01-02T03:04:05Z",
                }
            ]
        }
    }
    said = kube._not_ready(unknown)
    assert said is not None
    assert said[0] == "Ready=Unknown NodeStatusUnknown: Kubelet stopped posting node status."
    assert said[1] == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_the_crds_default_node_lost_seconds_is_the_operators() -> None:
    crd = yaml.safe_load(Path("crds/trainingjob.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = spec["properties"]["runPolicy"]["properties"]["nodeLostSeconds"]
    assert field["default"] == node_policy.DEFAULT_SECONDS


def test_a_secret_whose_data_changed_is_told_from_the_one_the_operator_made() -> None:
    j = job()
    made = builders.secret(j, {"ca.crt": b"ca", "tj-ps-0.key": b"key"})
    assert kube.secret_changed(made) == ""
    changed = {**made, "data": {**made["data"], "tj-ps-0.key": "b3RoZXI="}}
    assert "no longer has the digest it was made with" in kube.secret_changed(changed)
    added = {**made, "data": {**made["data"], "extra": "eA=="}}
    assert kube.secret_changed(added) != ""
    # made by an operator that gave no digest: not taken for changed
    older = {**made, "metadata": {**made["metadata"], "annotations": {}}}
    assert kube.secret_changed(older) == ""
    # the key and value boundaries are part of the digest
    assert builders.secret_digest({"ab": "c"}) != builders.secret_digest({"a": "bc"})


def test_a_pod_kubernetes_deletes_itself_is_counted_once_and_said_once() -> None:
    j = job(ps=1, workers=2, run={"backoffLimit": 0})
    step(j, pods(j))
    ps, worker0, worker1 = pods(j)
    evicted = dataclasses.replace(
        worker1,
        uid="w1-a",
        deleting=True,
        disruption="EvictionByEvictionAPI: Eviction API: evicting",
    )
    first = step(j, [ps, worker0, evicted])
    assert first.status["restarts"] == 1
    assert first.status["state"] != "Failed"
    [event] = [e for e in first.events if e.reason == "PodDisrupted"]
    assert "worker 1 (pod tj-worker-1) was ended by Kubernetes: EvictionByEvictionAPI" in (
        event.message
    )
    again = step(j, [ps, worker0, evicted])  # still terminating: nothing counted again
    assert again.status["restarts"] == 1
    assert not [e for e in again.events if e.reason == "PodDisrupted"]
    gone = step(j, [ps, worker0])
    assert "disrupted" not in gone.status  # forgotten once gone
    assert gone.status["restarts"] == 1


def test_a_failed_pod_kubernetes_evicted_is_not_counted_again_while_it_terminates() -> None:
    j = job(ps=1, workers=2)
    step(j, pods(j))
    ps, worker0, worker1 = pods(j, worker1=("Failed", 137))
    evicted = dataclasses.replace(
        worker1, uid="w1-a", disruption="TerminationByKubelet: node low on memory"
    )
    assert step(j, [ps, worker0, evicted]).status["restarts"] == 1
    deleting = dataclasses.replace(evicted, deleting=True)
    assert step(j, [ps, worker0, deleting]).status["restarts"] == 1


class Nodes:
    """Answers GET /api/v1/nodes/<name> from `nodes` (a status code for an error)."""

    def __init__(self, nodes: dict[str, dict[str, Any] | int]) -> None:
        self.nodes, self.calls = nodes, 0

    def call(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        self.calls += 1
        found = self.nodes[path.rsplit("/", 1)[1]]
        if isinstance(found, int):
            raise ApiError(status=found, reason="refused")
        return found


def test_a_pods_node_is_read_once_per_interval_and_an_unreadable_one_is_not_lost() -> None:
    down = {
        "status": {
            "conditions": [
                {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"},
            ]
        }
    }
    api = Nodes({"a": down, "b": 403, "c": 404})
    cluster = kube.KubeCluster(api=api)  # type: ignore[arg-type]
    pod = PodState("tj-worker-0", "worker", 0, "Running", node="a")
    lost = cluster._on_lost_node(pod)
    assert lost.node_lost == "Ready=Unknown NodeStatusUnknown"
    assert lost.node_lost_since is not None
    assert cluster._on_lost_node(dataclasses.replace(pod, name="tj-worker-1")).node_lost
    assert api.calls == 1  # one read for both pods of node a
    assert cluster._on_lost_node(dataclasses.replace(pod, ready=True)).node_lost == ""
    assert cluster._on_lost_node(dataclasses.replace(pod, node="b")).node_lost == ""  # no RBAC
    assert cluster._on_lost_node(dataclasses.replace(pod, node="c")).node_lost == (
        "the node is deleted"
    )
    unscheduled = dataclasses.replace(pod, phase="Pending", node="")
    assert cluster._on_lost_node(unscheduled) is unscheduled
