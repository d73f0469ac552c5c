"""The planner: what a TrainingJob's children should be, and what to do about them.

    plan(job, observed, now, network=..., metrics=...) -> Plan(create, delete, status, events,
                                                               replaced, requeue_after, delete_job)

A pure function, with no client and no I/O: the reconcile pass (`reconcile`) carries Plans out
on either backend. It is level-based: from the job (defaults applied, status included), the
pods that exist, the chief's metrics and where the tasks are (`builders.Network`), it computes
the whole desired status (`status.progress` included) and the actions that converge to it, so
running it twice on the same input gives the same Plan. One pass, in order:

0. the progress (`progress.update`): the chief's metrics, or its final summary once it ended;
   the workers (`policy.scale`): those past the worker count leave (deleted, never replaced nor
   counted as failed), `status.workers`, an Event for each change of the count;
1. suspend (`policy.suspend`): a suspended job's pods are deleted (ps last), none created;
2. the training configuration: a `spec.training` the runtime would refuse fails the job
   before any pod starts (InvalidTraining), and so does a template that sets a jaxps variable
   to a value the runtime would refuse (InvalidTemplate);
3. success (`policy.success`) before failure: a chief that succeeded, or recorded its final
   summary before it was killed, ends the job Succeeded even when a ps failed in the same pass;
   one that exited 0 without its summary fails it (NoOutcome);
4. children (`builders`): the headless Service, the Secret of the job's credentials and its
   NetworkPolicy when missing; then, for a job in a Kueue queue, admission
   (`policy.admission`): no pod until Kueue admits it, its pods stopped when evicted; then the
   deadline (`policy.deadline`, counted from the admission) and every missing pod, placed on
   the admitted flavors; a pod is never recreated while its predecessor is still terminating;
5. failed pods (`policy.restart`): replaced, or the job fails (at once for a final exit code);
6. pods on a lost node (`policy.node`): said while their node is NotReady, deleted at once
   and replaced past `nodeLostSeconds`; pods that wait (`policy.schedule`), the Restarting,
   Running and PodsReady conditions, and the Stalled backstop (`policy.stall`);
7. once finished: the TTL (`policy.deadline`) and `policy.cleanup`.

Where TFJob hurts, see research/tfjob-anchor.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jaxps_operator import builders, capacity, kueue, progress, schema
from jaxps_operator.conditions import Event, Status, stamp
from jaxps_operator.objects import FOREIGN, Plan, PodState, json_copy
from jaxps_operator.policy import admission as admission_policy
from jaxps_operator.policy import (
    cleanup,
    deadline,
    node,
    restart,
    scale,
    schedule,
    stall,
    success,
    suspend,
)

__all__ = ["Event", "Plan", "PodState", "plan"]


def _counts(
    job: Mapping[str, Any], *, observed: Sequence[PodState], previous: Mapping[str, Any]
) -> dict[str, dict[str, int]]:
    counts = {
        role: {
            "pending": 0,
            "active": 0,
            "ready": 0,
            "succeeded": 0,
            "failed": 0,
            "restarts": int(
                (previous.get("replicaStatuses") or {}).get(role, {}).get("restarts", 0)
            ),
        }
        for role in builders.replicas(job)
    }
    for p in observed:
        if p.role in counts:
            c = counts[p.role]
            c["pending"] += p.phase == "Pending"
            c["active"] += p.phase == "Running"
            c["ready"] += p.phase == "Running" and p.ready
            c["succeeded"] += p.phase == "Succeeded"
            c["failed"] += p.phase == "Failed"
    # a count of 0 is left out, as Kubernetes' own statuses do (omitempty): every field a job
    # holds makes each write of it cost the API server more CPU
    return {role: {k: n for k, n in c.items() if n} for role, c in counts.items()}


def plan(
    job: Mapping[str, Any],
    observed: Sequence[PodState],
    now: datetime,
    *,
    network: builders.Network,
    service_exists: bool = True,
    image: str = builders.DEFAULT_IMAGE,
    credentials: Mapping[str, bytes] | None = None,
    network_policy: bool = False,
    metrics: Mapping[str, float] | None = None,
    admission: kueue.Admission | None = None,
    issued_workers: int | None = None,
    refused: tuple[str, str] | None = None,
) -> Plan:
    """The Plan for `job` (validated, defaults applied) given its pods at `now` (aware UTC).
    `credentials`: the files of the job's Secret when it has none yet (it is created then);
    `network_policy`: the job's NetworkPolicy is to be created; `metrics`: the jaxps_*
    metrics the chief served this pass ({} when it runs not or did not answer); `admission`:
    what Kueue says of a job in a queue (None: the job is not Kueue's); `issued_workers`: the
    workers its credentials hold certificates for (None: none issued yet); `refused`: (reason,
    words) when a child of the job could not be made: the API server refused it as invalid
    (InvalidTemplate), or its name is held by an object the job does not own (NameTaken), or
    its Secret was changed while it ran (SecretChanged); the job fails.

    The job runs with its worker replicas cut to what it may have (`capacity.within`); the
    workers past them are leaving (`policy.scale`): deleted, and seen by no other policy."""
    out = Plan()
    asked = job
    job = capacity.within(asked, issued_workers=issued_workers)
    everyone = observed
    gone = {p.name for p in scale.leaving(job, observed)}
    observed = [p for p in observed if p.name not in gone]
    generation = int(job["metadata"].get("generation", 1))
    status = Status(json_copy(dict(job.get("status") or {})), now=now, generation=generation)
    body = status.body
    body["observedGeneration"] = generation
    body["replicaStatuses"] = _counts(job, observed=observed, previous=body)
    total = sum(builders.replicas(job).values())
    ready = sum(c.get("ready", 0) for c in body["replicaStatuses"].values())
    body["readyReplicas"] = f"{ready}/{total}"
    body.setdefault("restarts", 0)
    chief = chief_pod(job, observed)
    if chief is not None:
        made = progress.update(
            body.get("progress") or {}, chief=chief, metrics=metrics or {}, now=now
        )
        if made:  # none before the chief's first metrics: no empty object stored
            body["progress"] = made
    name = job["metadata"]["name"]
    if not body.get("conditions"):
        status.mark("Created", True, "JobCreated", f"TrainingJob {name} created: {total} pods")
        status.event("Normal", "JobCreated", f"created TrainingJob {name}")
    scale.apply(
        asked,
        running=job,
        pods=everyone,
        status=status,
        plan=out,
        issued_workers=issued_workers,
    )

    taken = [p for p in everyone if p.foreign]
    if taken and not refused:  # a pod of the job's name and labels that is not the job's
        pod = taken[0]
        refused = ("NameTaken", f"Pod {pod.name} {FOREIGN}")
    if refused and not status.finished:  # no retry makes the API server take it
        reason, words = refused
        status.finish(
            succeeded=False,
            reason=reason,
            message=words
            if reason in ("NameTaken", "SecretChanged")
            else f"the API server refused a child of this job as invalid: {words}",
        )
    if not status.finished:
        _run(
            job,
            observed=observed,
            status=status,
            out=out,
            network=network,
            service_exists=service_exists,
            image=image,
            credentials=credentials,
            network_policy=network_policy,
            training=chief is not None and progress.training(metrics or {}),
            admission=admission,
        )
    if status.finished:
        deadline.after_finish(job, status=status, plan=out)
        cleanup.apply(job, pods=everyone, status=status, plan=out)
    out.delete = list(dict.fromkeys(out.delete))  # a pod two policies delete goes once
    body["state"] = status.state()
    out.status = body
    out.events = status.events
    return out


def _run(
    job: Mapping[str, Any],
    *,
    observed: Sequence[PodState],
    status: Status,
    out: Plan,
    network: builders.Network,
    service_exists: bool,
    image: str,
    credentials: Mapping[str, bytes] | None,
    network_policy: bool,
    training: bool,
    admission: kueue.Admission | None,
) -> None:
    if suspend.apply(job, pods=observed, status=status, plan=out):
        return
    for check, reason, why in (
        (
            schema.training_problems,
            "InvalidTraining",
            "the training configuration is invalid for this job",
        ),
        (
            schema.container_problems,
            "InvalidTemplate",
            "a template does not say which container jaxps runs in",
        ),
        (
            schema.setting_problems,
            "InvalidTemplate",
            "a template sets a jaxps variable to a value the runtime refuses",
        ),
    ):
        problems = check(job)
        if problems:
            status.finish(
                succeeded=False,
                reason=reason,
                message=f"{why}, no pod started: " + "; ".join(map(str, problems)),
            )
            return
    pods = {(p.role, p.index): p for p in observed}
    who = success.succeeded(job, pods)
    if who is not None:  # the outcome is recorded: no pod failing now changes it
        error = (status.body.get("progress") or {}).get("checkpointError")
        status.finish(
            succeeded=True,
            reason="JobSucceeded",
            message=f"{who} succeeded"
            + (f"; but its final checkpoint failed: {error}" if error else ""),
        )
        if error:
            status.event("Warning", "CheckpointFailed", f"the final checkpoint failed: {error}")
        return
    early = success.without_outcome(job, pods)
    if early is not None:  # exit 0 is no outcome without the summary
        status.finish(succeeded=False, reason="NoOutcome", message=early)
        return
    if credentials is not None:  # none read: never issued, or deleted
        alive = [p for p in observed if not p.deleting and p.phase in ("Pending", "Running")]
        if alive:  # new keys for a replaced pod only would not be trusted by the others
            pod = alive[0]
            status.finish(
                succeeded=False,
                reason="SecretLost",
                message=f"the job's Secret {builders.secret_name(job)} (its tasks' TLS "
                f"credentials) is gone while pod {pod.name} ({pod.task}) runs with them: a "
                "pod started now would hold keys its peers do not trust; run the job again "
                "(with a checkpoint directory it resumes from the last checkpoint)",
            )
            return
    if not service_exists:
        out.create.append(builders.service(job))
    if credentials is not None:  # issued before any pod: every task gets keys of one CA
        out.create.append(builders.secret(job, credentials))
    if network_policy:
        out.create.append(builders.network_policy(job))
    if admission_policy.apply(job, admission=admission, pods=observed, status=status, plan=out):
        return
    status.body.setdefault("startTime", stamp(status.now))
    deadline.active(job, status=status, plan=out)
    if status.finished:
        return

    restarting: list[str] = []
    for role, index in builders.tasks(job):
        p = pods.get((role, index))
        if p is None:
            manifest = builders.pod(job, role, index, network=network, image=image)
            if admission is not None:
                manifest = kueue.place(manifest, admission.placement.get(role), role)
            out.create.append(manifest)
        elif p.deleting:
            restart.on_disrupted(p, status=status, plan=out)
            restarting.append(f"{role} {index}")  # recreated once it is gone, never before
        elif p.phase == "Failed":
            restart.on_failure(job, p, status=status, plan=out)
            if status.finished:
                return
            restarting.append(f"{role} {index}")

    restart.forget_gone(observed, status=status)
    on_lost_node = node.apply(job, pods=observed, status=status, plan=out)
    waits = schedule.apply(job, pods=observed, status=status, plan=out) or on_lost_node
    if status.finished:
        return
    _progressing(job, pods=pods, restarting=restarting, status=status, waits=waits)
    stall.check(job, status=status, plan=out, training=training)


def chief_pod(job: Mapping[str, Any], pods: Sequence[PodState]) -> PodState | None:
    """The chief's pod (or worker 0's) unless it is being deleted."""
    name = builders.pod_name(job, *builders.chief_task(job))
    return next((p for p in pods if p.name == name and not p.deleting), None)


def _progressing(
    job: Mapping[str, Any],
    *,
    pods: Mapping[tuple[str, int], PodState],
    restarting: list[str],
    status: Status,
    waits: bool,
) -> None:
    """The Restarting, Running and PodsReady conditions of a job that goes on; `waits`: some
    pod waits for a reason, and PodsReady already says which (`policy.schedule`)."""
    everyone = builders.tasks(job)
    if restarting:
        status.mark("Restarting", True, "PodReplaced", f"replacing {', '.join(restarting)}")
    elif status.true("Restarting") and all(
        (p := pods.get(task)) is not None and p.phase in ("Running", "Succeeded")
        for task in everyone
    ):
        status.mark("Restarting", False, "PodsReplaced", "every replaced pod is running again")
    role, index = builders.chief_task(job)
    chief = pods.get((role, index))
    if (
        chief is not None
        and chief.phase == "Running"
        and not chief.deleting
        and not status.true("Running")
    ):
        status.mark("Running", True, "JobRunning", f"{role} {index} is running")
        status.event("Normal", "JobRunning", f"{job['metadata']['name']} is running")
    ready = sum(1 for p in pods.values() if p.phase == "Running" and p.ready and not p.deleting)
    was = status.condition("PodsReady")
    if waits:
        return
    if ready == len(everyone) and not status.true("PodsReady"):
        status.mark("PodsReady", True, "PodsReady", f"all {ready} pods are running and ready")
    elif ready < len(everyone) and was is not None and was["reason"] != "PodsNotReady":
        # was True, or said why a pod waited, which it no longer does
        status.mark("PodsReady", False, "PodsNotReady", f"{ready} of {len(everyone)} pods ready")
