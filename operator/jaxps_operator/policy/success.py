"""Success policy: `chief` (the chief, or worker 0 without one, succeeded) or `allWorkers`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxps_operator import builders
from jaxps_operator.objects import PodState


def succeeded(job: Mapping[str, Any], pods: Mapping[tuple[str, int], PodState]) -> str | None:
    """Who succeeded, when that ends the job; None while it has not."""
    if job["spec"]["successPolicy"] == "allWorkers":
        workers = builders.replicas(job)["worker"]
        done = all(
            (p := pods.get(("worker", i))) is not None and p.phase == "Succeeded"
            for i in range(workers)
        )
        return "every worker" if done else None
    role, index = builders.chief_task(job)
    chief = pods.get((role, index))
    if chief is not None and chief.phase == "Succeeded" and (chief.exit_code or 0) == 0:
        return f"{role} {index}"
    return None
