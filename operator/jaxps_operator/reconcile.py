"""One reconcile pass of one TrainingJob, on any `Cluster`: Kubernetes or local processes.

    reconcile(cluster, namespace, name, now=..., validator=...) -> Outcome

    GET the job -> its children (pods, Service, Secret, NetworkPolicy) -> fresh credentials
    if it has none -> the chief's metrics -> planner.plan(...) -> one status write, only if it
    changed -> delete, then create -> Events -> delete the job once its TTL is over

The operator runs it behind its watches and its work queue (`controller`), one pass per job
at a time in a worker thread; `jaxps local` runs it in a loop (`local`). Level-based: a pass
may be repeated, or cut short by a conflict, at any point. The status goes out before the
pods are touched: a pass cut short by a conflict has then replaced nothing, so the next one
counts each replacement (`status.restarts`) once; counted after the deletes, a conflict lost it
and the replaced pod, seen leaving, was never counted again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from jaxps_operator import builders, capacity, kueue, planner, schema
from jaxps_operator.conditions import TERMINAL, Event
from jaxps_operator.objects import PodState, json_copy

log = logging.getLogger("jaxps.operator")


@dataclass(frozen=True)
class Children:
    """A job's children as observed: its pods, and whether its Service, the Secret of its
    credentials and its NetworkPolicy exist; `issued_workers`: the workers the credentials
    hold certificates for (`capacity.issued_workers`; None while there are none)."""

    pods: list[PodState]
    service: bool
    secret: bool = True
    network_policy: bool = True
    issued_workers: int | None = None
    taken: list[str] = field(default_factory=list)  # its names held by someone else's objects
    secret_changed: str = ""  # how the Secret of its credentials differs from what was made


class ConflictError(Exception):
    """The job changed since it was read: the pass is repeated."""


class Workloads(Protocol):
    """Kueue's Workloads, ResourceFlavors and priority classes (`kueue_api`). Writes are
    guarded by the resourceVersion read (409 -> `ConflictError`)."""

    def get(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        """The job's Workload, or None; `kueue.UnavailableError` when Kueue's API is missing."""

    def priority(self, group: str, kind: str, name: str) -> int | None:
        """The value of a WorkloadPriorityClass or PriorityClass; None when it is missing."""

    def flavors(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The `spec` of each ResourceFlavor named that exists."""

    def apply(self, action: kueue.Action) -> None:
        """Carries out one write (`kueue.actions`)."""

    def orphans(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """The Workloads labelled with a job of that name that still hold the finalizer."""


class Cluster(Protocol):
    """Where jobs run. Creating what exists and deleting what is gone count as success."""

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored job (status included), or None when it is gone."""

    def children(self, job: Mapping[str, Any]) -> Children:
        """Its pods (a pod of another job with the same name counts as leaving) and Service."""

    def network(self, job: Mapping[str, Any]) -> builders.Network:
        """Where the job's tasks are: what its pods' TF_CONFIG names (the tasks of `job` as
        given: with every worker it is issued for, when the credentials are issued)."""

    def credentials(self, job: Mapping[str, Any], network: builders.Network) -> dict[str, bytes]:
        """Fresh credentials for a job that has none: the files of its Secret, for every task
        of `job` (given with every worker it may ever have: `capacity.at_capacity`)."""

    def create(self, job: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
        """Creates a Pod or the Service; False when it already exists. Raises `RefusedError`
        when the API server refuses it as invalid (400, 422): no retry would change that."""

    def delete_pod(self, job: Mapping[str, Any], name: str, *, force: bool = False) -> bool:
        """Deletes a pod, gracefully, or at once with `force` (a pod on a lost node); False
        when it was already gone."""

    def write_status(self, job: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        """Writes the status of `job` as it was read; `ConflictError` if it changed since."""

    def post_event(self, job: Mapping[str, Any], event: Event) -> None:
        """Records an Event about the job."""

    def delete_job(self, job: Mapping[str, Any]) -> None:
        """Deletes the job and, with it, its children."""

    def task_progress(self, pod: PodState) -> dict[str, float]:
        """The jaxps_* metrics a running task serves; {} when it does not answer."""


@dataclass
class Outcome:
    state: str | None  # None: the job is gone
    requeue_after: float | None = None
    replaced: list[tuple[str, int]] = field(default_factory=list)  # (role, index) of each


class RefusedError(Exception):
    """The API server refused a child as invalid (a pod template it does not take, a Secret
    past its size): the message is its words, naming the object. `reason`: the job's."""

    reason = "InvalidTemplate"


class NameTakenError(RefusedError):
    """A child's name is held by an object the job does not own (no ownerReference with its
    uid): never adopted, changed or deleted; the job fails naming it."""

    reason = "NameTaken"


@dataclass
class Validator:
    """Jobs validated against the CRD with defaults applied, once per uid and generation (the
    CEL rules are slow). Shared by the worker threads of the operator: one lock guards it.
    `rules=False` leaves the CEL rules out: the operator reads jobs the apiserver admitted
    under the same CRD's rules (the chart's copy is checked against ours), and evaluating
    them again with cel-python was a third of its CPU while 100 jobs were created."""

    rules: bool = True
    cache: dict[tuple[str, str], tuple[str, int, dict[str, Any]]] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)  # uids whose invalid spec was posted
    refused: dict[str, RefusedError] = field(default_factory=dict)  # uid -> a child refused
    lock: threading.Lock = field(default_factory=threading.Lock)

    def job(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """`raw` validated, defaults applied, with its metadata and status; a copy."""
        meta = raw["metadata"]
        key = (str(meta.get("namespace", "")), str(meta["name"]))
        uid, generation = str(meta.get("uid", "")), int(meta.get("generation", 0))
        with self.lock:
            cached = self.cache.get(key)
        if cached is None or cached[:2] != (uid, generation):
            cached = (
                uid,
                generation,
                schema.validate({k: v for k, v in raw.items() if k != "status"}, rules=self.rules),
            )
            with self.lock:
                current = self.cache.get(key)
                if current is None or current[0] != uid or current[1] <= generation:
                    self.cache[key] = cached
        return json_copy(
            {
                **cached[2],
                # the API server's field bookkeeping, half the metadata, is read by no policy
                "metadata": {k: v for k, v in meta.items() if k != "managedFields"},
                "status": raw.get("status") or {},
            }
        )

    def first_report(self, uid: str) -> bool:
        """True once per uid: whether its invalid spec is still to be reported."""
        with self.lock:
            new = uid not in self.reported
            self.reported.add(uid)
            return new

    def forget(self, namespace: str, name: str) -> None:
        """The job is gone: its cache entry goes too."""
        with self.lock:
            gone = self.cache.pop((namespace, name), None)
            if gone is not None:
                self.refused.pop(gone[0], None)


def reconcile(
    cluster: Cluster,
    namespace: str,
    name: str,
    *,
    now: datetime,
    validator: Validator,
    image: str = builders.DEFAULT_IMAGE,
    progress_interval: float | None = None,
    parallel: Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]] = map,
    network_policy: bool = False,
    workloads: Workloads | None = None,
) -> Outcome:
    """One pass over job `namespace/name`. `parallel` maps a call over the deletes, then over
    the creates (a thread pool's `map` on Kubernetes); `progress_interval` asks for another
    pass that soon while the chief runs; `network_policy` gives the job a NetworkPolicy;
    `workloads`: Kueue's API, for jobs labelled with a queue (None: the label is ignored)."""
    raw = cluster.get_job(namespace, name)
    if raw is None or raw["metadata"].get("deletionTimestamp"):
        validator.forget(namespace, name)
        if workloads is not None:  # its Workloads are the garbage collector's now
            for wl in workloads.orphans(namespace, name):
                workloads.apply(kueue.release_finalizer(wl, "the TrainingJob is deleted"))
        return Outcome(state=None)
    try:
        job = validator.job(raw)
    except schema.InvalidManifestError as err:
        # the API server enforces the same schema, so this is a CRD older than the operator
        if validator.first_report(str(raw["metadata"].get("uid", ""))):
            cluster.post_event(raw, Event("Warning", "InvalidSpec", str(err)))
        return Outcome(state=(raw.get("status") or {}).get("state", "Created"))
    children = cluster.children(job)
    issued = children.issued_workers
    # the workers the job runs now, within what it was issued: new pods' TF_CONFIG lists them
    network = cluster.network(capacity.within(job, issued_workers=issued))
    finished = (job["status"].get("state") or "") in TERMINAL
    queue = _queue(
        job, workloads, image=image, finished=finished, pods=children.pods, issued=issued
    )
    if queue is None and workloads is not None and _was_queued(job):
        # the queue label was removed: the job runs without Kueue, its Workload goes
        for wl in workloads.orphans(namespace, name):  # deleted, then its finalizer goes
            if wl["metadata"].get("deletionTimestamp"):
                workloads.apply(kueue.release_finalizer(wl, "the job left its queue"))
            else:
                workloads.apply(kueue.Action("delete", wl, "the job left its queue"))
    chief = planner.chief_pod(job, children.pods)
    running = chief is not None and chief.phase == "Running"
    fresh = None
    if not children.secret and not finished:  # one certificate per worker it may ever have
        full = capacity.at_capacity(job)
        fresh = cluster.credentials(full, cluster.network(full))
    plan = planner.plan(
        job,
        children.pods,
        now,
        network=network,
        service_exists=children.service,
        image=image,
        credentials=fresh,
        network_policy=network_policy and not children.network_policy,
        metrics=cluster.task_progress(chief)
        if chief is not None and running and not finished
        else {},
        admission=queue.admission if queue is not None else None,
        issued_workers=issued,
        refused=_refusal(validator.refused.get(str(job["metadata"].get("uid", ""))))
        or (("NameTaken", children.taken[0]) if children.taken else None)
        or (("NameTaken", queue.taken) if queue is not None and queue.taken else None)
        or (_secret_changed(job, children.secret_changed) if children.secret_changed else None),
    )
    status = plan.status
    # the Workload first: whoever reads the job's Succeeded or Failed finds its quota given back
    if (
        queue is not None
        and workloads is not None
        and not queue.admission.problem
        and not queue.taken
    ):
        for action in kueue.actions(
            {**job, "status": status},
            state=status["state"],
            wl=queue.workload,
            desired=queue.desired,
            pods=children.pods,
            now=now,
        ):
            log.info("TrainingJob %s/%s: Workload %s: %s", namespace, name, action.verb, action.why)
            workloads.apply(action)
    if status != job["status"]:
        cluster.write_status(raw, status)
    gone = list(parallel(lambda n: cluster.delete_pod(job, n, force=n in plan.force), plan.delete))
    deleted = [n for n, ok in zip(plan.delete, gone, strict=True) if ok]
    made = list(parallel(lambda m: _create(cluster, job, m), plan.create))
    created = [
        f"{m['kind']} {m['metadata']['name']}"
        for m, ok in zip(plan.create, made, strict=True)
        if ok is True
    ]
    refusals = [r for r in made if isinstance(r, RefusedError)]
    if refusals:  # the next pass fails the job, naming it
        with validator.lock:
            validator.refused[str(job["metadata"].get("uid", ""))] = refusals[0]
        plan.events.append(Event("Warning", "CreateRefused", str(refusals[0])))
        requeue_now = True
    else:
        requeue_now = False
    if deleted:
        plan.events.append(Event("Normal", "PodsDeleted", f"deleted pod {', '.join(deleted)}"))
    if created:
        plan.events.append(Event("Normal", "Created", f"created {', '.join(created)}"))
    for event in plan.events:
        cluster.post_event(raw, event)
    if plan.delete_job:
        log.info("TrainingJob %s/%s: ttlSecondsAfterFinished is over: deleted", namespace, name)
        cluster.delete_job(raw)
        validator.forget(namespace, name)
        return Outcome(state=None, replaced=plan.replaced)
    requeue = 0.0 if requeue_now else plan.requeue_after
    if progress_interval is not None and running and status["state"] not in TERMINAL:
        requeue = min(progress_interval if requeue is None else requeue, progress_interval)
    return Outcome(state=status["state"], requeue_after=requeue, replaced=plan.replaced)


@dataclass(frozen=True)
class _Queue:
    workload: dict[str, Any] | None
    desired: dict[str, Any]
    admission: kueue.Admission
    taken: str = ""  # the Workload's name is held by one the job does not own: never touched


def _queue(
    job: Mapping[str, Any],
    workloads: Workloads | None,
    *,
    image: str,
    finished: bool,
    pods: Sequence[PodState],
    issued: int | None,
) -> _Queue | None:
    """What Kueue says of a job in a queue, and the Workload it wants; None otherwise. The
    flavors are read only while a pod is to be created (they place new pods, nothing else)."""
    if workloads is None or kueue.queue_name(job) is None:
        return None
    problem = ""
    taken = ""
    try:
        wl = workloads.get(job)
    except kueue.UnavailableError as err:
        wl, problem = None, str(err)
    except NameTakenError as err:
        wl, taken = None, str(err)
    priority = kueue.Priority()
    source = kueue.priority_source(job)
    if source is not None and wl is None and not problem and not finished:
        value = workloads.priority(*source)
        if value is None:
            _, kind, name = source
            problem = f"{kind} {name!r} (from {_source_field(kind)}) does not exist"
        else:
            priority = kueue.Priority(value, *source)
    elif wl is not None:  # what it was created with: pod sets, not priority, make it stale
        spec = wl.get("spec") or {}
        ref = spec.get("priorityClassRef") or {}
        priority = kueue.Priority(
            int(spec.get("priority") or 0),
            str(ref.get("group", "")),
            str(ref.get("kind", "")),
            str(ref.get("name", "")),
        )
    desired = kueue.workload(
        job,
        priority=priority,
        image=image,
        workers=capacity.capacity(job, issued_workers=issued),
    )
    present = {(p.role, p.index) for p in pods}
    running = capacity.within(job, issued_workers=issued)
    missing = any(task not in present for task in builders.tasks(running))
    flavors = (
        workloads.flavors(kueue.flavor_names(wl))
        if wl is not None and missing and kueue.condition(wl, "Admitted") and not finished
        else {}
    )
    return _Queue(
        workload=wl,
        desired=desired,
        admission=kueue.admission(job, wl, desired=desired, flavors=flavors, problem=problem),
        taken=taken,
    )


def _was_queued(job: Mapping[str, Any]) -> bool:
    """Whether the job was once in a Kueue queue (it has a Queued or Admitted condition)."""
    return any(
        c.get("type") in ("Queued", "Admitted")
        for c in (job.get("status") or {}).get("conditions") or []
    )


def _secret_changed(job: Mapping[str, Any], how: str) -> tuple[str, str]:
    return (
        "SecretChanged",
        f"the job's Secret {builders.secret_name(job)} (its tasks' TLS credentials) was changed "
        f"while the job ran: {how}; its tasks hold the keys it was made with, and a pod started "
        "now would hold keys its peers may not trust. Run the job again (it resumes from its "
        "last checkpoint); to rotate a job's credentials, suspend it and delete the Secret",
    )


def _source_field(kind: str) -> str:
    if kind == kueue.WORKLOAD_PRIORITY[1]:
        return f"label {kueue.PRIORITY_LABEL}"
    return "a template's spec.priorityClassName"


def _refusal(error: RefusedError | None) -> tuple[str, str] | None:
    return (error.reason, str(error)) if error is not None else None


def _create(
    cluster: Cluster, job: Mapping[str, Any], manifest: Mapping[str, Any]
) -> bool | RefusedError:
    """`cluster.create`, a refusal as invalid returned rather than raised."""
    try:
        return cluster.create(job, manifest)
    except RefusedError as err:
        return err
