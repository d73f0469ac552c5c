"""Stall policy: the operator's backstop for a chief that stopped making progress.

The chief checks its own progress (`training.progressTimeoutSeconds`, exit 81 Stalled); this
policy catches a chief that cannot (hung in a call, its check itself stuck): while the job is
Running and the chief says it trains (`jaxps_training` 1), a global step that has not moved
for `progressTimeoutSeconds + BACKSTOP_SECONDS` (`status.progress.stepTime`, held while the
chief does not train) fails the job (Stalled). The chief's own check comes first by
`BACKSTOP_SECONDS`. 0 turns both off. A timer asks for the pass when it is due.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxps_operator.conditions import Status, parse_time
from jaxps_operator.objects import Plan

BACKSTOP_SECONDS = 60.0  # the chief's own check fires first by this much
DEFAULT_TIMEOUT_SECONDS = 600.0  # the CRD's default for training.progressTimeoutSeconds


def check(job: Mapping[str, Any], *, status: Status, plan: Plan, training: bool) -> None:
    """Fails the job when its step has not moved for too long while the chief trains."""
    timeout = float(
        (job["spec"].get("training") or {}).get("progressTimeoutSeconds", DEFAULT_TIMEOUT_SECONDS)
    )
    if not timeout or not training or not status.true("Running") or status.finished:
        return
    progress = status.body.get("progress") or {}
    since = parse_time(progress.get("stepTime"))
    if since is None:
        return
    limit = timeout + BACKSTOP_SECONDS
    still = (status.now - since).total_seconds()
    if still >= limit:
        status.finish(
            succeeded=False,
            reason="Stalled",
            message=f"the global step has not moved from {progress.get('step', 0)} for "
            f"{still:.0f} s while the chief trains (training.progressTimeoutSeconds "
            f"{timeout:g} s, and the operator waits {BACKSTOP_SECONDS:g} s more for the chief's "
            "own check)",
        )
    else:
        plan.wake_in(limit - still)
