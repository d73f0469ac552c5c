"""A start that does not progress is named: an init container that has not finished (native
sidecars run on), a volume the kubelet cannot mount (its Warning), the jaxps container's own
waiting reason even while a sidecar runs; and `scheduleTimeoutSeconds` bounds each."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from jaxps_operator import kube
from jaxps_operator.policy import schedule
from tests.unit.test_planner import NOW, job, pods, step

SCHEDULED = {"type": "PodScheduled", "status": "True"}


def _pod(
    phase: str = "Pending",
    *,
    init: list[dict[str, Any]] | None = None,
    init_statuses: list[dict[str, Any]] | None = None,
    main: dict[str, Any] | None = None,
    sidecar: dict[str, Any] | None = None,
) -> dict[str, Any]:
    statuses = [{"name": "jaxps", "state": main or {"waiting": {"reason": "PodInitializing"}}}]
    containers: list[dict[str, Any]] = [{"name": "jaxps"}]
    if sidecar is not None:
        containers.append({"name": "shipper"})
        statuses.append({"name": "shipper", "state": sidecar})
    return {
        "metadata": {
            "name": "tj-worker-1",
            "uid": "p-1",
            "labels": {"jaxps.dev/replica-type": "worker", "jaxps.dev/replica-index": "1"},
            "ownerReferences": [{"uid": "u"}],
            "creationTimestamp": "2026-11-21T12:00:00Z",
        },
        "spec": {"containers": containers, "initContainers": init or []},
        "status": {
            "phase": phase,
            "conditions": [SCHEDULED],
            "initContainerStatuses": init_statuses or [],
            "containerStatuses": statuses,
        },
    }


def test_an_init_container_that_runs_on_is_named_and_a_native_sidecar_is_not() -> None:
    pod = _pod(
        init=[{"name": "proxy", "restartPolicy": "Always"}, {"name": "fetch-data"}],
        init_statuses=[
            {"name": "proxy", "state": {"running": {"startedAt": "2026-11-21T12:00:01Z"}}},
            {"name": "fetch-data", "state": {"running": {"startedAt": "2026-11-21T12:00:02Z"}}},
        ],
    )
    for seen in (pod, kube.slim_pod(pod)):
        state = kube.pod_state(seen, "u")
        assert state is not None
        assert state.waiting_reason == "Initializing"
        assert state.waiting_message == (
            "init container 'fetch-data' has run since 2026-11-21T12:00:02Z and not finished"
        )
        assert not state.starting


def test_an_init_container_that_cannot_start_is_named_with_the_kubelets_words() -> None:
    pod = _pod(
        init=[{"name": "fetch-data"}],
        init_statuses=[
            {
                "name": "fetch-data",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}},
            }
        ],
    )
    state = kube.pod_state(pod, "u")
    assert state is not None
    assert (state.waiting_reason, state.waiting_message) == (
        "ImagePullBackOff",
        "init container 'fetch-data': no such image",
    )


def test_the_jaxps_container_waits_named_though_a_sidecar_made_the_pod_running() -> None:
    pod = _pod(
        "Running",
        main={"waiting": {"reason": "ErrImagePull", "message": "pull access denied"}},
        sidecar={"running": {}},
    )
    state = kube.pod_state(pod, "u")
    assert state is not None
    assert (state.phase, state.waiting_reason, state.waiting_message) == (
        "Running",
        "ErrImagePull",
        "pull access denied",
    )


def test_a_scheduled_pod_whose_container_is_being_created_is_starting() -> None:
    state = kube.pod_state(_pod(main={"waiting": {"reason": "ContainerCreating"}}), "u")
    assert state is not None
    assert state.starting
    assert not state.waiting_reason
    running = kube.pod_state(_pod("Running", main={"running": {}}), "u")
    assert running is not None
    assert not running.starting


def _event(reason: str, message: str, at: str, uid: str | None = "p-1") -> dict[str, Any]:
    return {
        "reason": reason,
        "message": message,
        "lastTimestamp": at,
        "involvedObject": {"kind": "Pod", "name": "tj-worker-1", "uid": uid},
    }


def test_the_kubelets_last_mount_warning_is_why_the_pod_waits() -> None:
    events = [
        _event("FailedMount", 'secret "old" not found', "2026-11-21T12:00:05Z"),
        _event("FailedMount", 'secret "creds" not found', "2026-11-21T12:00:20Z"),
        _event("FailedMount", "of an earlier pod of the name", "2026-11-21T12:00:30Z", uid="p-0"),
        _event("BackOff", "not a start's", "2026-11-21T12:00:40Z"),
    ]
    assert kube.kubelet_said(events, "p-1") == (
        "MountFailed",
        'FailedMount: secret "creds" not found',
    )
    assert kube.kubelet_said(events[3:], "p-1") == ("", "")


@pytest.mark.parametrize(
    ("why", "reason"),
    [
        ("Initializing", "InitTimeout"),
        ("MountFailed", "MountFailed"),
        ("ErrImagePull", "ErrImagePull"),
    ],
)
def test_a_pod_that_waited_past_the_timeout_fails_the_job_with_a_reason_per_cause(
    why: str, reason: str
) -> None:
    j = job(ps=1, workers=1, run={"scheduleTimeoutSeconds": 60})
    step(j, pods(j, "Pending"))
    created = NOW - timedelta(seconds=61)
    waiting = [
        p.__class__(
            **{**p.__dict__, "created": created, "waiting_reason": why, "waiting_message": "x"}
        )
        for p in pods(j, "Pending")
    ]
    result = step(j, waiting)
    assert result.status["state"] == "Failed"
    failed = next(c for c in result.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == reason
    assert "past runPolicy.scheduleTimeoutSeconds (60 s)" in failed["message"]


def test_a_starting_pod_asks_for_a_pass_to_read_why_it_waits() -> None:
    j = job(ps=1, workers=1)
    step(j, pods(j, "Pending"))
    starting = [p.__class__(**{**p.__dict__, "starting": True}) for p in pods(j, "Pending")]
    assert step(j, starting).requeue_after == schedule.RECHECK_SECONDS
