"""Restart policy: what a failed pod means for its job.

- exit code 78 (`EXIT_INVALID_TRAINING`): the task found its training configuration invalid;
  another pod would find the same, so the job fails at once (InvalidTraining, with the task's
  own message), whatever the role's policy;
- otherwise the pod is replaced (same name, once its predecessor is gone) when the role's
  `restartPolicy` says so: OnFailure and Always always, ExitCode for codes >= 128 (signals,
  OOM), Never never, and then the job fails (ReplicaFailed, naming role, index and exit code);
- every replacement counts in `status.restarts` and per role; past `runPolicy.backoffLimit`
  the job fails (BackoffLimitExceeded).

jaxps tasks exit 0 only once training is over (a ps when the chief shuts it down), so Always
acts as OnFailure: a pod that exited 0 is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxps_operator.conditions import Status
from jaxps_operator.objects import Plan, PodState
from jaxps_runtime.config import EXIT_INVALID_TRAINING

RETRYABLE_EXIT_CODE = 128  # ExitCode policy: codes from here on (signals, OOM) are retried


def may_replace(policy: str, exit_code: int | None) -> bool:
    if exit_code == EXIT_INVALID_TRAINING:
        return False
    if policy in ("OnFailure", "Always"):
        return True
    if policy == "ExitCode":
        return exit_code is None or exit_code >= RETRYABLE_EXIT_CODE
    return False


def on_failure(job: Mapping[str, Any], pod: PodState, *, status: Status, plan: Plan) -> None:
    """Replaces the failed `pod`, or ends the job; `status.finished` tells which."""
    policy = job["spec"]["replicaSpecs"][pod.role]["restartPolicy"]
    limit = job["spec"]["runPolicy"]["backoffLimit"]
    task, code = f"{pod.role} {pod.index}", pod.exit_code
    if code == EXIT_INVALID_TRAINING:
        said = pod.message.strip() or "no message"
        status.finish(
            succeeded=False,
            reason="InvalidTraining",
            message=f"{task} (pod {pod.name}) refused its training configuration "
            f"(exit code {code}): {said}",
        )
        return
    if not may_replace(policy, code):
        why = f"exit code {code}" if code is not None else f"reason {pod.reason or '?'}"
        status.finish(
            succeeded=False,
            reason="ReplicaFailed",
            message=f"{task} (pod {pod.name}) failed with {why}; its restartPolicy is {policy}",
        )
        return
    body = status.body
    body["restarts"] += 1
    body["replicaStatuses"][pod.role]["restarts"] += 1
    if body["restarts"] > limit:
        status.finish(
            succeeded=False,
            reason="BackoffLimitExceeded",
            message=f"{body['restarts']} pod replacements exceed runPolicy.backoffLimit "
            f"({limit}); the last: {task} exit code {code}",
        )
        return
    plan.delete.append(pod.name)
    plan.replaced.append((pod.role, pod.index))
    status.event(
        "Warning",
        "PodReplaced",
        f"{task} (pod {pod.name}) failed with exit code {code}; replacing it "
        f"(restartPolicy {policy})",
    )
