"""Schedule policy: pods that wait, and for how long they may (`runPolicy.scheduleTimeoutSeconds`).

A pod whose jaxps container does not run yet and that waits for a reason (the scheduler's
PodScheduled=False, `Unschedulable: 0/1 nodes are available: 1 Insufficient cpu`; an init
container of the user's that has not finished, Initializing; the kubelet's Warning that it
cannot mount a volume, MountFailed; or the container's waiting reason, ErrImagePull,
ImagePullBackOff, CreateContainerConfigError) makes the job's PodsReady condition False with
that reason and a message naming the pod and the scheduler's (or kubelet's) words, and posts a
Warning Event once per change of why pods wait, not of which one waits longest or how many more
do (a job whose pods start one by one posted one per pod, each a write on the API server). With
`scheduleTimeoutSeconds` set, the job fails with that reason (InitTimeout for an init container
that has not finished) once a pod has waited that long since it was created (until its jaxps
container runs, not until it is scheduled); a timer asks for that pass, so it fires without
another event. A worker the job can do without (not worker 0 acting as chief, and at least
`minReplicas` other workers run: `scale.spare`) never fails it: past the timeout the message
says the job goes on without it, and it joins once it runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from jaxps_operator import capacity
from jaxps_operator.conditions import Status
from jaxps_operator.objects import INITIALIZING, Plan, PodState
from jaxps_operator.policy import scale

QUIET_SECONDS = 5.0
"""A pod younger than this that waits is not reported yet: its claim may be binding, its
image being pulled (the scheduler says Unschedulable for the second a fresh claim is unbound)."""


_WHICH = re.compile(r"^pod \S+ \([^)]*\) waits: | \(and \d+ more pods wait\)")


def _told(message: str) -> str:
    """What an Event about waiting pods tells: why they wait, not which pod waits longest nor
    how many more do (both change as the pods start one by one)."""
    return _WHICH.sub("", message)


RECHECK_SECONDS = 10.0
"""While a scheduled pod starts with nothing said of why, a pass every this often (the
Kubernetes backend then reads the kubelet's Warnings on it: a volume it cannot mount)."""
TIMEOUT_REASONS = {INITIALIZING: "InitTimeout"}
"""The job's reason when a pod waited past the timeout, where it differs from why it waits."""


def waiting(pods: Iterable[PodState], *, now: datetime) -> list[PodState]:
    """The pods that wait for a reason (their jaxps container not running yet: a pod whose
    sidecar runs is Running before it), the longest-waiting first."""
    waits = [
        p for p in pods if p.phase in ("Pending", "Running") and p.waiting_reason and not p.deleting
    ]
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
    pods = list(pods)
    if any(p.starting and not p.deleting for p in pods):
        plan.wake_in(RECHECK_SECONDS)
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
    timeout = job["spec"]["runPolicy"].get("scheduleTimeoutSeconds")
    past = timeout and first.created is not None and _waited(first, now=status.now) >= timeout
    if past and scale.spare(job, first, pods) is not None:  # a stable message: one Event
        message += (
            f"; past runPolicy.scheduleTimeoutSeconds ({timeout} s) the job goes on "
            f"without it, with the workers that run (at least minReplicas "
            f"{capacity.minimum(job)}), and takes it in once it runs"
        )
    before = dict(status.condition("PodsReady") or {})  # a copy: mark changes it in place
    status.mark("PodsReady", False, reason, message, add=True)
    if (before.get("status"), before.get("reason"), _told(str(before.get("message")))) != (
        "False",
        reason,
        _told(message),
    ):
        status.event("Warning", reason, message)
    if not timeout:
        return True
    for pod in waits:  # a worker the job can do without holds it back from no deadline
        if pod.created is None or scale.spare(job, pod, pods) is not None:
            continue
        waited = _waited(pod, now=status.now)
        if waited >= timeout:
            why = f"{pod.waiting_reason}: {pod.waiting_message}" if pod.waiting_message else ""
            status.finish(
                succeeded=False,
                reason=TIMEOUT_REASONS.get(pod.waiting_reason, pod.waiting_reason),
                message=f"pod {pod.name} ({pod.task}) waited {waited:.0f} s, past "
                f"runPolicy.scheduleTimeoutSeconds ({timeout} s): "
                f"{why or pod.waiting_reason}",
            )
            return True
        plan.wake_in(timeout - waited)
    return True


def _waited(pod: PodState, *, now: datetime) -> float:
    return (now - pod.created).total_seconds() if pod.created is not None else 0.0
