"""runPolicy.oomPolicy: an OOM-killed task replaced with its role's memory raised, at most to
the ceiling; refused, naming why, at the ceiling, without a limit, or under Kueue."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from jaxps_operator import builders, schema
from jaxps_operator.policy import memory
from tests.unit.test_planner import job, pods, step


@pytest.mark.parametrize(
    ("text", "count"),
    [("50Mi", 50 * 2**20), ("1.5Gi", 3 * 2**29), ("2G", 2 * 10**9), ("1048576", 2**20)],
)
def test_quantities_read_as_kubernetes_writes_them(text: str, count: int) -> None:
    assert memory.to_bytes(text) == count


@pytest.mark.parametrize("text", ["", "1e3", "5 Mi", "-1Mi", "1.Gi", "twoGi"])
def test_anything_else_is_no_quantity(text: str) -> None:
    assert memory.to_bytes(text) is None


def _oom_job(policy: dict[str, Any] | None, **labels: str) -> dict[str, Any]:
    run: dict[str, Any] = {"backoffLimit": 6}
    if policy is not None:
        run["oomPolicy"] = policy
    j = job(ps=1, workers=1, policy="Never", run=run)
    j["metadata"]["labels"] = labels
    container = {
        "name": "jaxps",
        "resources": {"limits": {"memory": "50Mi"}, "requests": {"memory": "50Mi"}},
    }
    j["spec"]["replicaSpecs"]["worker"]["template"] = {"spec": {"containers": [container]}}
    return j


def _killed(j: dict[str, Any], limit: str = "50Mi") -> list[Any]:
    ps, worker = pods(j, worker0=("Failed", 137))
    return [ps, dataclasses.replace(worker, container_reason="OOMKilled", memory_limit=limit)]


def test_an_oom_killed_worker_is_replaced_with_its_memory_doubled_and_its_pods_get_it() -> None:
    j = _oom_job({"factor": 2, "maxMemory": "1Gi"})
    step(j, pods(j))
    result = step(j, _killed(j))
    assert result.status["state"] != "Failed"  # restartPolicy Never: the policy replaces it
    assert result.status["memory"] == {"worker": "100Mi"}
    assert result.status["restarts"] == 1
    [event] = [e for e in result.events if e.reason == "MemoryRaised"]
    assert "raised to 100Mi (runPolicy.oomPolicy: x2, at most 1Gi)" in event.message
    pod = builders.pod(j, "worker", 0, network=builders.dns_network(j))
    [main] = pod["spec"]["containers"]
    assert main["resources"] == {"limits": {"memory": "100Mi"}, "requests": {"memory": "100Mi"}}
    ps = builders.pod(j, "ps", 0, network=builders.dns_network(j))
    assert "resources" not in ps["spec"]["containers"][0]  # another role keeps its own


@pytest.mark.parametrize(
    ("limit", "ceiling", "raised"), [("700Mi", "1Gi", "1Gi"), ("50Mi", "75Mi", "75Mi")]
)
def test_a_raise_stops_at_the_ceiling(limit: str, ceiling: str, raised: str) -> None:
    j = _oom_job({"factor": 2, "maxMemory": ceiling})
    step(j, pods(j))
    assert step(j, _killed(j, limit)).status["memory"] == {"worker": raised}


@pytest.mark.parametrize(
    ("limit", "labels", "said"),
    [
        ("1Gi", {}, "runPolicy.oomPolicy raises it no further: 1Gi is at its maxMemory (1Gi)"),
        (
            "50Mi",
            {"kueue.x-k8s.io/queue-name": "team"},
            "runPolicy.oomPolicy raises no memory of a job in a Kueue queue (team)",
        ),
    ],
    ids=["at-the-ceiling", "under-kueue"],
)
def test_a_raise_refused_fails_the_job_oom_killed_saying_why(
    limit: str, labels: dict[str, str], said: str
) -> None:
    j = _oom_job({"factor": 2, "maxMemory": "1Gi"}, **labels)
    step(j, pods(j))
    result = step(j, _killed(j, limit))
    failed = next(c for c in result.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "OOMKilled"
    assert said in failed["message"], failed["message"]
    assert "memory" not in result.status


def test_without_the_policy_an_oom_kill_fails_as_before() -> None:
    j = _oom_job(None)
    step(j, pods(j))
    failed = next(c for c in step(j, _killed(j)).status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "OOMKilled"
    assert failed["message"].endswith("; its restartPolicy is Never")


def test_the_crd_refuses_a_policy_without_a_ceiling_or_with_a_bad_one() -> None:
    base: dict[str, Any] = {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "tj"},
        "spec": {
            "replicaSpecs": {"ps": {"replicas": 1}, "worker": {"replicas": 1}},
            "training": {"steps": 10},
        },
    }
    for policy, words in [
        ({"factor": 2}, "spec.runPolicy.oomPolicy.maxMemory: Required value"),
        ({"maxMemory": "lots"}, "spec.runPolicy.oomPolicy.maxMemory"),
        ({"maxMemory": "1Gi", "factor": 1}, "spec.runPolicy.oomPolicy.factor"),
    ]:
        body = {**base, "spec": {**base["spec"], "runPolicy": {"oomPolicy": policy}}}
        with pytest.raises(schema.InvalidManifestError) as err:
            schema.validate(body)
        assert words in str(err.value)
