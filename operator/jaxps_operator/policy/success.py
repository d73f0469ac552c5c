"""Success policy: `chief` (the chief, or worker 0 without one, succeeded) or `allWorkers`.

The chief's outcome is the truth: a chief whose pod ended without exit 0 (killed as the job
wound down) but whose termination message already holds its final `{"event": "done", ...}`
summary recorded that outcome, and the job succeeded. The planner asks this before it looks
at failed pods, so a ps killed late in the same pass is neither replaced nor a failure.

Exit 0 alone is not the outcome: a chief (or worker 0) whose pod ended with exit 0 but whose
termination message holds no summary did not finish training (user code that called
`os._exit(0)`, a process ended from outside its own code): `without_outcome` says so, and the
job fails (NoOutcome) rather than reading as Succeeded with nothing trained.
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
    if (
        chief.phase == "Succeeded"
        and (chief.exit_code or 0) == 0
        and progress.summary(chief.message) is not None
    ):
        return f"{role} {index}"
    if chief.phase == "Failed" and progress.summary(chief.message) is not None:
        how = f"exit code {chief.exit_code}" if chief.exit_code is not None else "no exit code"
        return f"{role} {index} (its final summary was recorded before it ended with {how})"
    return None


def without_outcome(job: Mapping[str, Any], pods: Mapping[tuple[str, int], PodState]) -> str | None:
    """Why the job failed when its chief (or worker 0) exited 0 without recording its final
    summary; None otherwise (and always under `allWorkers`: workers record no summary)."""
    if job["spec"]["successPolicy"] == "allWorkers":
        return None
    role, index = builders.chief_task(job)
    chief = pods.get((role, index))
    if chief is None or chief.phase != "Succeeded" or (chief.exit_code or 0) != 0:
        return None
    if progress.summary(chief.message) is not None:
        return None
    return (
        f"{role} {index} (pod {chief.name}) exited 0 without recording the job's outcome (its "
        "final summary): it ended before training was over, not by jaxps' own hand (user code "
        "that calls os._exit(0), or a process that ran instead of the runtime); read its log"
    )
