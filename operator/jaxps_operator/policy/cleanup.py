"""Cleanup policy: what happens to the pods of a finished job (`runPolicy.cleanPodPolicy`).

`Running` (the default) deletes every pod that still runs or waits, so no ps outlives its job;
`All` deletes every pod; `None` leaves them. A finished job gets no new pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from jaxps_operator.objects import Plan, PodState


def apply(job: Mapping[str, Any], *, pods: Iterable[PodState], plan: Plan) -> None:
    policy = job["spec"]["runPolicy"]["cleanPodPolicy"]
    for p in pods:
        if p.deleting or p.name in plan.delete:
            continue
        if policy == "All" or (
            policy == "Running" and p.phase in ("Pending", "Running", "Unknown")
        ):
            plan.delete.append(p.name)
    plan.create = []
