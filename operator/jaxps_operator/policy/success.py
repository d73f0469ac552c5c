"""Success policy: `chief` (the chief, or worker 0 without one, succeeded) or `allWorkers`.

The chief's outcome is the truth: a chief whose pod ended without exit 0 (killed as the job
wound down) but whose termination message already holds its final `{"event": "done", ...}`
summary recorded that outcome, and the job succeeded. The planner asks this before it looks
at failed pods, so a ps killed late in the same pass is neither replaced nor a failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxps_operator import builders, progress
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
    if chief is None:
        return None
    if chief.phase == "Succeeded" and (chief.exit_code or 0) == 0:
        return f"{role} {index}"
    if chief.phase == "Failed" and progress.summary(chief.message) is not None:
        how = f"exit code {chief.exit_code}" if chief.exit_code is not None else "no exit code"
        return f"{role} {index} (its final summary was recorded before it ended with {how})"
    return None
