"""Time policies: `activeDeadlineSeconds` while the job runs, `ttlSecondsAfterFinished` after.

Both are real timers: the pass asks to be run again when one is due (`Plan.requeue_after`),
never "on the next event". The deadline counts from `status.startTime` (reset by a resume).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from jaxps_operator.conditions import Status, parse_time
from jaxps_operator.objects import Plan


def active(job: Mapping[str, Any], *, status: Status, plan: Plan) -> None:
    """Fails the job once its deadline is over; else sets the timer for it."""
    deadline = job["spec"]["runPolicy"].get("activeDeadlineSeconds")
    started = parse_time(status.body.get("startTime"))
    if not deadline or started is None:
        return
    left = (started + timedelta(seconds=deadline) - status.now).total_seconds()
    if left <= 0:
        status.finish(
            succeeded=False,
            reason="DeadlineExceeded",
            message=f"the job was active longer than runPolicy.activeDeadlineSeconds "
            f"({deadline} s)",
        )
    else:
        plan.requeue_after = left


def after_finish(job: Mapping[str, Any], *, status: Status, plan: Plan) -> None:
    """A finished job: deleted once its TTL is over, else a timer for then; no deadline."""
    ttl = job["spec"]["runPolicy"].get("ttlSecondsAfterFinished")
    completed = parse_time(status.body.get("completionTime"))
    plan.requeue_after = None  # no deadline, stall or schedule timer once finished
    if ttl is None or completed is None:
        return
    left = (completed + timedelta(seconds=ttl) - status.now).total_seconds()
    if left <= 0:
        plan.delete_job = True
    else:
        plan.wake_in(left)
