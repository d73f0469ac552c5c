"""Scale policy: workers join and leave a running job (`spec.replicaSpecs.worker.replicas`).

A scale-up needs nothing here: the planner creates the missing pods (new indexes; each one's
TF_CONFIG lists the cluster as it is when the pod is created, and no pod that exists is ever
made again for it). A scale-down removes the highest indexes first (never worker 0): their
pods are deleted, and the runtime's worker drains on SIGTERM (finishes its batch, gives its
data lease back to the chief, exits 0). A worker removed so is *leaving* until its pod is gone:
whatever it exits with, it is never replaced nor counted as a failure or a restart.

`status.workers` says it: desired (what runs now), active, leaving, max (`capacity`) and the
selector of the worker pods (the scale subresource's, for a HorizontalPodAutoscaler). Each
change of the desired count is one Event (ScaledUp, ScaledDown), found by comparing with the
count the last pass wrote; a count above what the job was issued at creation runs at the
capacity, and ScalingLimited (with one ScaleRefused Event) says why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxps_operator import builders, capacity
from jaxps_operator.conditions import Status
from jaxps_operator.objects import Plan, PodState

LIMITED = "ScalingLimited"


def leaving(job: Mapping[str, Any], pods: Iterable[PodState]) -> list[PodState]:
    """The worker pods past the job's worker count (`job` as it runs: `capacity.within`)."""
    count = builders.replicas(job).get(capacity.WORKER, 0)
    return [p for p in pods if p.role == capacity.WORKER and p.index >= count]


def selector(job: Mapping[str, Any]) -> str:
    """The label selector of the job's worker pods, as a string (`status.workers.selector`)."""
    labels = builders.labels(job, capacity.WORKER)
    return ",".join(f"{k}={v}" for k, v in labels.items())


def spare(job: Mapping[str, Any], pod: PodState, pods: Sequence[PodState]) -> int | None:
    """When `pod` is a worker the job can do without (it is not the chief's worker 0, and
    at least minReplicas other workers run), the count of those workers; else None."""
    if pod.role != capacity.WORKER or (pod.role, pod.index) == builders.chief_task(job):
        return None
    running = sum(
        1
        for p in pods
        if p.role == capacity.WORKER and p.phase == "Running" and not p.deleting and p != pod
    )
    return running if running >= capacity.minimum(job) else None


def apply(
    job: Mapping[str, Any],
    *,
    running: Mapping[str, Any],
    pods: Sequence[PodState],
    status: Status,
    plan: Plan,
    issued_workers: int | None,
) -> None:
    """`job` as asked, `running` as it runs (`capacity.within`): deletes the leaving workers'
    pods (highest index first), writes `status.workers`, and posts the Event of a change. A
    finished job only has its counts updated."""
    desired = builders.replicas(running).get(capacity.WORKER, 0)
    gone = sorted(leaving(running, pods), key=lambda p: -p.index)
    previous = (status.body.get("workers") or {}).get("desired")
    active = sum(
        1
        for p in pods
        if p.role == capacity.WORKER
        and p.index < desired
        and p.phase == "Running"
        and not p.deleting
    )
    top = capacity.capacity(job, issued_workers=issued_workers)
    status.body["workers"] = {
        "desired": desired,
        "active": active,
        "leaving": len(gone),
        "max": top,
        "selector": selector(job),
        "summary": f"{active}/{desired}",
    }
    if status.finished:
        return
    plan.delete += [p.name for p in gone if not p.deleting and p.name not in plan.delete]
    if isinstance(previous, int) and previous != desired:
        if desired > previous:
            status.event("Normal", "ScaledUp", f"worker replicas {previous} -> {desired}")
        else:
            drain = ", ".join(f"worker-{i}" for i in range(previous - 1, desired - 1, -1))
            status.event(
                "Normal", "ScaledDown", f"worker replicas {previous} -> {desired}: {drain} drain"
            )
    asked = int(job["spec"]["replicaSpecs"][capacity.WORKER]["replicas"])
    why = capacity.refusal(job, asked, issued_workers=issued_workers) if asked > desired else None
    if why is not None:
        message = f"{why}; running {desired} workers"
        was = status.condition(LIMITED) or {}
        status.mark(LIMITED, True, "AboveIssuedWorkers", message)
        if (was.get("status"), was.get("message")) != ("True", message):
            status.event("Warning", "ScaleRefused", message)
    elif status.true(LIMITED):
        status.mark(LIMITED, False, "WithinCapacity", f"running the {desired} workers asked for")
