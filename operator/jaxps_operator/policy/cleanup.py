"""Cleanup policy: what happens to the pods of a finished job (`runPolicy.cleanPodPolicy`).

`Running` (the default) deletes every pod that still runs or waits, so no ps outlives its job
(nor a pod kept running by a sidecar of the user's after its jaxps container ended);
`All` deletes every pod; `None` leaves them. A finished job gets no new pod.

A job that SUCCEEDED has told its tasks to stop (workers stop, the chief shuts every ps down):
its pods still Running are finishing on their own, and their logs must stay. Under `Running`
they are deleted only once `RUNNING_GRACE_SECONDS` have passed since `completionTime` (a timer
asks for that pass); Pending and Unknown pods go at once. A FAILED job's pods go at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from jaxps_operator.conditions import Status, parse_time
from jaxps_operator.objects import Plan, PodState

RUNNING_GRACE_SECONDS = 30.0  # a succeeded job's running pods: time to end on their own


def apply(job: Mapping[str, Any], *, pods: Iterable[PodState], status: Status, plan: Plan) -> None:
    policy = job["spec"]["runPolicy"]["cleanPodPolicy"]
    completed = parse_time(status.body.get("completionTime"))
    grace = 0.0
    if status.true("Succeeded") and completed is not None:
        end = completed + timedelta(seconds=RUNNING_GRACE_SECONDS)
        grace = (end - status.now).total_seconds()
    for p in pods:
        if p.deleting or p.name in plan.delete:
            continue
        running = p.phase == "Running" or p.lingering  # a sidecar may outlive jaxps's container
        if policy == "Running" and running and grace > 0:
            plan.wake_in(grace)  # it may end on its own meanwhile; else it goes then
            continue
        if policy == "All" or (
            policy == "Running" and (running or p.phase in ("Pending", "Unknown"))
        ):
            plan.delete.append(p.name)
    plan.create = []
