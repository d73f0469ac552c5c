"""Suspend policy: `runPolicy.suspend` deletes the job's pods (the ps last, so the chief,
told to stop, checkpoints the step they hold) and creates none until resumed; a resume
restarts the deadline's clock."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from jaxps_operator.conditions import Status
from jaxps_operator.objects import Plan, PodState
from jaxps_operator.policy import admission


def apply(job: Mapping[str, Any], *, pods: Iterable[PodState], status: Status, plan: Plan) -> bool:
    """True while the job is suspended (its pods are being deleted)."""
    name = job["metadata"]["name"]
    if job["spec"]["runPolicy"]["suspend"]:
        if not status.true("Suspended"):
            status.mark(
                "Suspended",
                True,
                "JobSuspended",
                "runPolicy.suspend is true: pods deleted, none created",
            )
            status.event("Normal", "JobSuspended", f"suspended {name}")
        for key in ("Running", "PodsReady", "Admitted"):
            if status.true(key):
                status.mark(key, False, "JobSuspended", "suspended")
        admission.stop(pods, plan=plan)  # ps last: the chief checkpoints first
        return True
    if status.true("Suspended"):
        status.mark(
            "Suspended", False, "JobResumed", "runPolicy.suspend is false: pods created again"
        )
        status.body.pop("startTime", None)  # the deadline counts from the resume
        status.event("Normal", "JobResumed", f"resumed {name}")
    return False
