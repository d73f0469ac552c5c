"""Admission policy (Kueue): a job in a queue runs only while its Workload is admitted.

Queued (no Workload yet, or Kueue has not admitted it): no pod is created, `Queued` says why in
Kueue's words. Admitted: `Admitted` names the ClusterQueue and flavors, and the pods are placed
on them (`kueue.place`). Evicted (preempted, its queue stopped, ...), its Workload deleted or
no longer the job's: `Preempted` says why, and the pods are stopped in order (`stop`): the chief,
the workers and the evaluator first, so the chief, told to stop, writes a checkpoint of the
step the ps hold; the ps only once those are gone. Nothing counts as a failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from jaxps_operator.conditions import Status
from jaxps_operator.kueue import Admission
from jaxps_operator.objects import Plan, PodState


def stop(pods: Iterable[PodState], *, plan: Plan) -> None:
    """Deletes the job's pods, ps last: while a chief, worker or evaluator pod exists (or
    leaves), the ps keep serving, so the chief's last checkpoint can be written."""
    pods = list(pods)
    others = [p for p in pods if p.role != "ps"]
    leaving = others if others else pods
    plan.delete += [p.name for p in leaving if not p.deleting]


def _why(admission: Admission) -> tuple[str, str]:
    if admission.problem:
        return "NotQueued", admission.problem
    if not admission.exists:
        return "WorkloadCreated", f"waiting for Kueue to admit Workload {admission.workload}"
    if admission.deleting:
        return "WorkloadDeleted", f"Workload {admission.workload} is being deleted: queued again"
    if admission.stale:
        return "WorkloadChanged", "the job's pod sets changed: its Workload is replaced"
    if admission.evicted is not None:
        reason, message = admission.evicted
        return reason or "Evicted", message
    reason, message = admission.pending
    return reason or "Pending", message or f"Workload {admission.workload} waits for admission"


def apply(
    job: Mapping[str, Any],
    *,
    admission: Admission | None,
    pods: Iterable[PodState],
    status: Status,
    plan: Plan,
) -> bool:
    """True while the job may not run (its pods are being stopped); False when it is not
    Kueue's or is admitted."""
    if admission is None:
        for key in ("Queued", "Admitted"):  # it was in a queue: its label was removed
            if status.true(key):
                status.mark(key, False, "QueueLabelRemoved", "the job runs without Kueue")
        return False
    name = job["metadata"]["name"]
    if admission.may_run:
        where = f"admitted by ClusterQueue {admission.cluster_queue or '?'}"
        if admission.flavors():
            where += f" on flavor {admission.flavors()}"
        if not status.true("Admitted"):
            status.mark("Admitted", True, "Admitted", where)
            status.event("Normal", "Admitted", f"{name}: {where}")
        if status.true("Queued"):
            status.mark("Queued", False, "Admitted", where)
        if status.true("Preempted"):
            status.mark("Preempted", False, "Readmitted", f"{where}: resumes from its checkpoint")
            status.body.pop("startTime", None)  # the deadline counts from the admission again
        return False
    reason, message = _why(admission)
    pods = list(pods)
    was_running = status.true("Admitted")
    # Deactivated: the job's own runPolicy.suspend (spec.active false), not a preemption
    evicted = admission.evicted is not None and admission.evicted[0] != "Deactivated"
    preempted = evicted or (was_running and bool(pods))
    if preempted and not status.true("Preempted"):
        detail = message
        if admission.preempted is not None:  # Kueue's Preempted reason: InClusterQueue, ...
            detail = f"{message} ({admission.preempted[0]})" if message else admission.preempted[0]
        status.mark("Preempted", True, reason, detail)
        status.event("Warning", "Preempted", f"{name}: {reason}: {detail}")
    if was_running:
        status.mark("Admitted", False, reason, message)
    if not status.true("Queued"):
        status.event("Normal", "Queued", f"{name} waits in LocalQueue {admission.queue}: {message}")
    status.mark("Queued", True, reason, message)
    for key in ("Running", "PodsReady", "Restarting"):
        if status.true(key):
            status.mark(key, False, reason, message)
    stop(pods, plan=plan)
    return True
