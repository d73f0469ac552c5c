"""Restart policy: what a failed pod means for its job.

- a final exit code (`config.FINAL_EXITS`: 78 InvalidTraining, 79 UserCodeError, 80 Diverged,
  81 Stalled): the task itself found an outcome another pod would find again, so the job fails
  at once with that reason and the task's own termination message (the cause), whatever the
  role's policy, and the pod is never replaced;
- otherwise the pod is replaced (same name, once its predecessor is gone) when the role's
  `restartPolicy` says so: OnFailure and Always always, ExitCode for codes >= 128 (signals,
  OOM), Never never, and then the job fails (ReplicaFailed, naming role, index and exit code;
  OOMKilled when the kernel's OOM killer ended it, naming its memory limit and what to change);
- every replacement counts in `status.restarts` and per role; past `runPolicy.backoffLimit`
  the job fails (BackoffLimitExceeded, or OOMKilled when the last failure was one), but for a
  pod Kubernetes ended itself (DisruptionTarget: preempted by the scheduler, evicted by the
  kubelet or the eviction API, its node lost), which is replaced whatever the count (Event
  PodDisrupted, naming Kubernetes' reason); a container the kubelet killed for a failing
  liveness probe is named so (LivenessProbeFailed) and counts as any failure;
- with `runPolicy.oomPolicy`, an OOM-killed pod is replaced whatever its role's policy, with
  the role's memory limit raised (`policy.memory`; Event MemoryRaised), or the job fails
  OOMKilled saying why it was not raised.

jaxps tasks exit 0 only once training is over (a ps when the chief shuts it down), so Always
acts as OnFailure: a pod that exited 0 is done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxps_operator import builders
from jaxps_operator.conditions import Status
from jaxps_operator.objects import Plan, PodState
from jaxps_operator.policy import memory
from jaxps_runtime.config.training import FINAL_EXITS

RETRYABLE_EXIT_CODE = 128  # ExitCode policy: codes from here on (signals, OOM) are retried

# How each final exit reads in the Failed condition: "<task> (pod <name>) <what> (exit code N)"
WHAT = {
    "InvalidTraining": "refused its training configuration",
    "UserCodeError": "failed in the user's code",
    "Diverged": "found the training diverged",
    "Stalled": "found the training stalled",
}


def may_replace(policy: str, exit_code: int | None) -> bool:
    if exit_code in FINAL_EXITS:
        return False
    if policy in ("OnFailure", "Always"):
        return True
    if policy == "ExitCode":
        return exit_code is None or exit_code >= RETRYABLE_EXIT_CODE
    return False


def oom_advice(job: Mapping[str, Any], pod: PodState) -> str:
    """What an OOM-killed pod's message says: its limit and the field that raises it."""
    name = job["metadata"]["name"]
    limit = f"its memory limit {pod.memory_limit}" if pod.memory_limit else "no memory limit"
    template = job["spec"]["replicaSpecs"][pod.role].get("template") or {}
    main = builders.main_index((template.get("spec") or {}).get("containers") or []) or 0
    field = f"spec.replicaSpecs.{pod.role}.template.spec.containers[{main}].resources.limits.memory"
    return (
        f"{pod.task} (pod {pod.name}) was OOMKilled (exit code {pod.exit_code}) with {limit}; "
        f"give {pod.role} more memory in {field} of TrainingJob {name}"
        + ("" if pod.memory_limit else " (or the node more)")
    )


def _how(pod: PodState) -> str:
    if pod.disruption:
        code = f" (exit code {pod.exit_code})" if pod.exit_code is not None else ""
        return f"was ended by Kubernetes{code}: {pod.disruption}"
    if pod.failed_init:
        said = f": {pod.message.strip()}" if pod.message.strip() else ""
        return f"failed: its init container {pod.failed_init!r} exited {pod.exit_code}{said}"
    if pod.oom_killed:
        return (
            f"was OOMKilled (exit code {pod.exit_code}, memory limit {pod.memory_limit or 'none'})"
        )
    if pod.exit_code is not None:
        return f"failed with exit code {pod.exit_code}"
    return f"failed with reason {pod.reason or '?'}"


def _disrupted(pod: PodState) -> bool:
    """Kubernetes ended the pod for reasons of its own (a DisruptionTarget condition), not for
    what its task did (a liveness probe that failed is the task's: it stopped answering)."""
    return bool(pod.disruption) and not pod.disruption.startswith("LivenessProbeFailed")


def count(pod: PodState, *, status: Status, plan: Plan) -> None:
    """Counts the replacement of `pod` in `status.restarts`, by role; one Kubernetes ended is
    remembered by uid in `status.disrupted` (while it is there), so it is counted once."""
    body = status.body
    body["restarts"] += 1
    counts = body["replicaStatuses"][pod.role]
    counts["restarts"] = counts.get("restarts", 0) + 1
    plan.replaced.append((pod.role, pod.index))
    if _disrupted(pod) and pod.uid:
        body.setdefault("disrupted", []).append(pod.uid)


def on_disrupted(pod: PodState, *, status: Status, plan: Plan) -> None:
    """A pod being deleted by Kubernetes itself (a DisruptionTarget condition: preempted by
    the scheduler, evicted through the eviction API, by a lost node's taint): counted once as a
    replacement, never against backoffLimit, with an Event PodDisrupted naming Kubernetes'
    reason; it is replaced once it is gone."""
    if not _disrupted(pod) or not pod.uid or pod.uid in status.body.get("disrupted", []):
        return
    count(pod, status=status, plan=plan)
    status.event(
        "Warning",
        "PodDisrupted",
        f"{pod.task} (pod {pod.name}) {_how(pod)}; replacing it once it is gone",
    )


def forget_gone(pods: Sequence[PodState], *, status: Status) -> None:
    """`status.disrupted` keeps only the uids of pods still there."""
    if "disrupted" not in status.body:
        return
    there = {p.uid for p in pods}
    kept = [uid for uid in status.body["disrupted"] if uid in there]
    if kept:
        status.body["disrupted"] = kept
    else:
        del status.body["disrupted"]


def on_failure(job: Mapping[str, Any], pod: PodState, *, status: Status, plan: Plan) -> None:
    """Replaces the failed `pod`, or ends the job; `status.finished` tells which."""
    policy = job["spec"]["replicaSpecs"][pod.role]["restartPolicy"]
    limit = job["spec"]["runPolicy"]["backoffLimit"]
    task, code = f"{pod.task} (pod {pod.name})", pod.exit_code
    if code is not None and code in FINAL_EXITS:
        reason = FINAL_EXITS[code]
        said = pod.message.strip() or "no message"
        status.finish(
            succeeded=False,
            reason=reason,
            message=f"{task} {WHAT.get(reason, 'ended the job')} (exit code {code}): {said}",
        )
        return
    more, why_not = memory.raised(job, pod) if pod.oom_killed else (None, "")
    if why_not:  # runPolicy.oomPolicy is set, and cannot raise this one
        status.finish(
            succeeded=False, reason="OOMKilled", message=f"{oom_advice(job, pod)}; {why_not}"
        )
        return
    if more is None and not may_replace(policy, code):
        if pod.oom_killed:
            status.finish(
                succeeded=False,
                reason="OOMKilled",
                message=f"{oom_advice(job, pod)}; its restartPolicy is {policy}",
            )
            return
        status.finish(
            succeeded=False,
            reason="ReplicaFailed",
            message=f"{task} {_how(pod)}; its restartPolicy is {policy}",
        )
        return
    body = status.body
    done = f"{body['restarts']} pod replacement{'' if body['restarts'] == 1 else 's'}"
    # counted only once it happens: status says what did; a pod Kubernetes ended (preempted,
    # evicted, its node lost: DisruptionTarget) is no failure of the job's and is replaced past
    # the limit, as a batch Job's podFailurePolicy ignores them
    if body["restarts"] + 1 > limit and not _disrupted(pod):
        if pod.oom_killed:
            status.finish(
                succeeded=False,
                reason="OOMKilled",
                message=f"{oom_advice(job, pod)}; {done} reached runPolicy.backoffLimit ({limit})",
            )
            return
        status.finish(
            succeeded=False,
            reason="BackoffLimitExceeded",
            message=f"{done} reached runPolicy.backoffLimit ({limit}); the next failure: "
            f"{task} {_how(pod)}",
        )
        return
    count(pod, status=status, plan=plan)
    plan.delete.append(pod.name)
    if more is not None:  # its successor, and every pod of the role after it, get `more`
        body.setdefault("memory", {})[pod.role] = more
        oom = job["spec"]["runPolicy"]["oomPolicy"]
        status.event(
            "Warning",
            "MemoryRaised",
            f"{task} {_how(pod)}; replacing it with {pod.role}'s memory limit raised to "
            f"{more} (runPolicy.oomPolicy: x{oom.get('factor', 2):g}, at most "
            f"{oom['maxMemory']})",
        )
        return
    status.event(
        "Warning",
        "PodDisrupted" if _disrupted(pod) else "PodReplaced",
        f"{task} {_how(pod)}; replacing it (restartPolicy {policy})",
    )
