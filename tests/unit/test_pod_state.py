"""kube.pod_state: what the planner needs of a Kubernetes pod, read from its manifest."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from jaxps_operator import kube


def pod(
    phase: str,
    *,
    conditions: list[dict[str, Any]] | None = None,
    state: dict[str, Any] | None = None,
    resources: dict[str, Any] | None = None,
) -> dict[str, Any]:
    main: dict[str, Any] = {"name": "jaxps"}
    if resources is not None:
        main["resources"] = resources
    return {
        "metadata": {
            "name": "tj-worker-1",
            "labels": {"jaxps.dev/replica-type": "worker", "jaxps.dev/replica-index": "1"},
            "ownerReferences": [{"uid": "u"}],
            "creationTimestamp": "2026-11-21T12:00:00Z",
        },
        "spec": {"containers": [main]},
        "status": {
            "phase": phase,
            "conditions": conditions or [],
            "containerStatuses": [{"name": "jaxps", "state": state or {}}],
        },
    }


def test_an_oom_killed_pod_carries_its_container_reason_and_memory_limit() -> None:
    killed = pod(
        "Failed",
        state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        resources={"limits": {"memory": "512Mi", "cpu": "1"}},
    )
    state = kube.pod_state(killed, "u")
    assert state is not None
    assert (state.exit_code, state.container_reason, state.memory_limit) == (
        137,
        "OOMKilled",
        "512Mi",
    )
    assert state.oom_killed


def test_a_plain_kill_is_no_oom_and_a_pod_without_a_limit_says_none() -> None:
    killed = kube.pod_state(
        pod("Failed", state={"terminated": {"exitCode": 137, "reason": "Error"}}), "u"
    )
    assert killed is not None
    assert not killed.oom_killed
    assert killed.memory_limit is None


def test_an_unschedulable_pod_says_the_schedulers_words_and_since_when() -> None:
    words = '0/1 nodes are available: persistentvolumeclaim "data" not found.'
    waiting = pod(
        "Pending",
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": words}
        ],
    )
    state = kube.pod_state(waiting, "u")
    assert state is not None
    assert (state.waiting_reason, state.waiting_message) == ("Unschedulable", words)
    assert state.created == datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    "reason", ["ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError"]
)
def test_a_container_that_cannot_start_says_why(reason: str) -> None:
    words = f"{reason}: something the kubelet said"
    state = kube.pod_state(
        pod("Pending", state={"waiting": {"reason": reason, "message": words}}), "u"
    )
    assert state is not None
    assert (state.waiting_reason, state.waiting_message) == (reason, words)


def test_a_container_on_its_normal_way_to_running_waits_for_nothing_wrong() -> None:
    for reason in ("ContainerCreating", "PodInitializing"):
        state = kube.pod_state(pod("Pending", state={"waiting": {"reason": reason}}), "u")
        assert state is not None
        assert state.waiting_reason == ""


def test_a_failed_init_container_is_named_with_its_exit_code_and_words() -> None:
    """The pod failed before its main container ran: the job's message read "failed with
    reason ?"."""
    failed = pod("Failed", state={"waiting": {"reason": "PodInitializing"}})
    failed["status"]["initContainerStatuses"] = [
        {"name": "fetch", "state": {"terminated": {"exitCode": 3, "message": "init broke"}}}
    ]
    state = kube.pod_state(kube.slim_pod(failed), "u")
    assert state is not None
    assert (state.exit_code, state.failed_init) == (3, "fetch")
    from jaxps_operator.policy import restart

    assert restart._how(state) == "failed: its init container 'fetch' exited 3: init broke"
