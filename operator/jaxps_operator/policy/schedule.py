"""Schedule policy: pods that wait, and for how long they may (`runPolicy.scheduleTimeoutSeconds`).

A Pending pod that waits for a reason (the scheduler's PodScheduled=False, `Unschedulable:
0/1 nodes are available: 1 Insufficient cpu`; or its container's waiting reason, ErrImagePull,
ImagePullBackOff, CreateContainerConfigError) makes the job's PodsReady condition False with
that reason and a message naming the pod and the scheduler's (or kubelet's) words, and posts a
Warning Event once per change of what it says. With `scheduleTimeoutSeconds` set, the job
fails with that reason once a pod has waited that long since it was created; a timer asks for
that pass, so it fires without another event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from jaxps_operator.conditions import Status
from jaxps_operator.objects import Plan, PodState

QUIET_SECONDS = 5.0
"""A pod younger than this that waits is not reported yet: its claim may be binding, its
image being pulled (the scheduler says Unschedulable for the second a fresh claim is unbound)."""


def waiting(pods: Iterable[PodState], *, now: datetime) -> list[PodState]:
    """The pods that wait for a reason, the longest-waiting first."""
    waits = [p for p in pods if p.phase == "Pending" and p.waiting_reason and not p.deleting]
    return sorted(waits, key=lambda p: (p.created or now, p.name))


def _young(pod: PodState, *, now: datetime) -> float | None:
    """Seconds until `pod` has waited `QUIET_SECONDS`; None once it has (or its age is not
    known)."""
    if pod.created is None:
        return None
    left = QUIET_SECONDS - (now - pod.created).total_seconds()
    return left if left > 0 else None


def apply(job: Mapping[str, Any], *, pods: Iterable[PodState], status: Status, plan: Plan) -> bool:
    """Reports the pods that wait, or fails the job past its schedule timeout; True when some
    pod waits (PodsReady then says why)."""
    waits = waiting(pods, now=status.now)
    if not waits:
        return False
    first = waits[0]
    quiet = _young(first, now=status.now)  # the longest-waiting is the oldest
    if quiet is not None:
        plan.wake_in(quiet)
        return False
    reason = first.waiting_reason
    said = f": {first.waiting_message}" if first.waiting_message else ""
    more = f" (and {len(waits) - 1} more pods wait)" if len(waits) > 1 else ""
    message = f"pod {first.name} ({first.task}) waits: {reason}{said}{more}"
    before = status.condition("PodsReady") or {}
    status.mark("PodsReady", False, reason, message, add=True)
    if (before.get("status"), before.get("reason"), before.get("message")) != (
        "False",
        reason,
        message,
    ):
        status.event("Warning", reason, message)
    timeout = job["spec"]["runPolicy"].get("scheduleTimeoutSeconds")
    if not timeout or first.created is None:
        return True
    waited = (status.now - first.created).total_seconds()
    if waited >= timeout:
        status.finish(
            succeeded=False,
            reason=reason,
            message=f"pod {first.name} ({first.task}) waited {waited:.0f} s, past "
            f"runPolicy.scheduleTimeoutSeconds ({timeout} s): {reason}{said}",
        )
    else:
        plan.wake_in(timeout - waited)
    return True
