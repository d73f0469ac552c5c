"""Kueue: a TrainingJob labelled `kueue.x-k8s.io/queue-name` is admitted as one unit.

Kueue has no controller for a TrainingJob (an "external framework" is only an owner table:
research/kueue.md, section 1), so jaxps plays the part of Kueue's job framework
(`pkg/controller/jobframework/reconciler.go`) itself, in the same level-based pass:

    workload(job, priority)            -> the Workload it keeps: one pod set per role
    admission(job, workload, flavors)  -> what Kueue says: queued, admitted (where), evicted
    actions(job, state, workload, ...) -> the writes that keep the Workload true

Pure functions; `kueue_api.Workloads` makes the calls. The planner creates no pod unless
`Admission.may_run` (`policy.admission`), so a queued job holds no quota and no node. The
contract, step by step, follows the reconciler:
- the Workload is created only while no pod of the job is active, with the finalizer
  `kueue.x-k8s.io/resource-in-use`, removed only once the job's pods are gone (a Workload
  deleted by hand keeps its quota until then) or the job is finished or deleted;
- admitted (`Admitted=True`, no `Evicted=True`): pods run with the flavors' node labels and
  tolerations; evicted: the pods are stopped (the chief first, which writes a checkpoint on
  SIGTERM, the ps last), then the reservation is released as Kueue's contract requires
  (`QuotaReserved=False`/Pending, no `admission`, `Admitted=False`, `Requeued`), or the quota
  and the preemptor stay stuck;
- finished: `Finished=True` (Succeeded or Failed); workers and evaluators done for good are
  `reclaimablePods`, so their quota is released while the job goes on;
- `runPolicy.suspend` is `spec.active: false` (Kueue evicts it, reason Deactivated);
- pod sets that no longer match the job: updated in place while unreserved, else the job is
  stopped and the Workload replaced.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from jaxps_operator import builders
from jaxps_operator.conditions import stamp
from jaxps_operator.objects import PodState

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
PODSET_LABEL = "kueue.x-k8s.io/podset"
FINALIZER = "kueue.x-k8s.io/resource-in-use"
WORKLOAD_PRIORITY = ("kueue.x-k8s.io", "WorkloadPriorityClass")
POD_PRIORITY = ("scheduling.k8s.io", "PriorityClass")
# Roles whose finished pods are done for good while the job goes on: their quota is released.
# Never ps (they serve to the end); a finished chief finishes the job.
RECLAIMABLE = ("worker", "evaluator")
# Evictions after which Kueue queues the job again at once (reconciler.go, step 6)
REQUEUED_ON = ("Preempted", "NodeFailures")
MAX_NAME = 253


def queue_name(job: Mapping[str, Any]) -> str | None:
    """The LocalQueue the job asks for, or None: the job is not Kueue's."""
    labels = job["metadata"].get("labels") or {}
    return str(labels[QUEUE_LABEL]) if labels.get(QUEUE_LABEL) else None


def workload_name(job: Mapping[str, Any]) -> str:
    """Kueue's own name for the Workload of a job (`jobframework/workload_names.go`):
    `trainingjob-<name>-<first 5 hex of sha1(kind, group, name, uid)>`."""
    meta = job["metadata"]
    name, uid = str(meta["name"]), str(meta.get("uid") or "")
    digest = hashlib.sha1(f"TrainingJob\njaxps.dev\n{name}\n{uid}".encode()).hexdigest()
    return f"{('trainingjob-' + name)[: MAX_NAME - 6]}-{digest[:5]}"


@dataclass(frozen=True)
class Priority:
    """The job's priority as Kueue's scheduler reads it (`spec.priority`) and where it came
    from: the `kueue.x-k8s.io/priority-class` label (a WorkloadPriorityClass), else a pod
    template's `priorityClassName` (a PriorityClass), else none (0)."""

    value: int = 0
    group: str = ""
    kind: str = ""
    name: str = ""


def priority_source(job: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(group, kind, name) of the class that sets the job's priority, or None."""
    labels = job["metadata"].get("labels") or {}
    if labels.get(PRIORITY_LABEL):
        return (*WORKLOAD_PRIORITY, str(labels[PRIORITY_LABEL]))
    for role in builders.ROLES:
        spec = job["spec"]["replicaSpecs"].get(role)
        name = (((spec or {}).get("template") or {}).get("spec") or {}).get("priorityClassName")
        if name:
            return (*POD_PRIORITY, str(name))
    return None


# What of a pod Kueue reads to charge quota and pick a flavor (requests, node constraints).
_POD_FIELDS = (
    "nodeSelector",
    "tolerations",
    "affinity",
    "priorityClassName",
    "runtimeClassName",
    "overhead",
)


def _container(c: Mapping[str, Any], image: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": str(c.get("name") or "jaxps"),
        "image": str(c.get("image") or image),
    }
    if c.get("resources"):  # quantities as text: the CRD takes an integer or a string
        out["resources"] = {
            kind: {str(k): str(v) for k, v in (values or {}).items()}
            for kind, values in c["resources"].items()
            if isinstance(values, Mapping)
        }
    if c.get("restartPolicy"):  # a sidecar (Always) is charged with the containers
        out["restartPolicy"] = str(c["restartPolicy"])
    return out


def pod_sets(
    job: Mapping[str, Any], *, image: str = builders.DEFAULT_IMAGE, workers: int | None = None
) -> list[dict[str, Any]]:
    """One pod set per role, in the order of `builders.ROLES`: the count of its replicas and a
    template with what Kueue charges (every container's requests) and matches flavors against
    (node selector, tolerations, affinity); the rest of the pod is jaxps's business. The
    workers' count is `workers`, the most the job can scale to (`capacity.capacity`), so the
    job is admitted for its largest size and a scale within it changes no pod set (a changed
    pod set would stop the job and queue it again); None: its replicas."""
    out = []
    for role, replicas in builders.replicas(job).items():
        count = workers if role == "worker" and workers is not None else replicas
        template = job["spec"]["replicaSpecs"][role].get("template") or {}
        spec = template.get("spec") or {}
        pod: dict[str, Any] = {
            "containers": [_container(c, image) for c in spec.get("containers") or [{}]]
        }
        if spec.get("initContainers"):
            pod["initContainers"] = [_container(c, image) for c in spec["initContainers"]]
        pod.update({k: copy.deepcopy(spec[k]) for k in _POD_FIELDS if spec.get(k)})
        out.append({"name": role, "count": count, "template": {"spec": pod}})
    return out


def workload(
    job: Mapping[str, Any],
    *,
    priority: Priority,
    image: str = builders.DEFAULT_IMAGE,
    workers: int | None = None,
) -> dict[str, Any]:
    """The Workload a job in a queue is admitted through (`jobframework.ConstructWorkload`);
    `workers`: the pod set count of its workers (`pod_sets`)."""
    meta = job["metadata"]
    spec: dict[str, Any] = {
        "queueName": queue_name(job) or "",
        "podSets": pod_sets(job, image=image, workers=workers),
        "active": not job["spec"]["runPolicy"]["suspend"],
    }
    if priority.kind:
        spec["priorityClassRef"] = {
            "group": priority.group,
            "kind": priority.kind,
            "name": priority.name,
        }
        spec["priority"] = priority.value
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job),
            "namespace": meta["namespace"],
            "labels": {builders.LABEL_JOB: meta["name"], JOB_UID_LABEL: str(meta.get("uid", ""))},
            "finalizers": [FINALIZER],
            "ownerReferences": [builders.owner_reference(job)],
        },
        "spec": spec,
    }


# --- what Kueue says -----------------------------------------------------------------------------


def condition(obj: Mapping[str, Any], type_: str, status: str = "True") -> dict[str, Any] | None:
    """The condition of that type on a Kueue object when its status is `status`, or None."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == status:
            return dict(c)
    return None


@dataclass(frozen=True)
class Placement:
    """Where an admitted pod set runs: its flavors' node labels and tolerations (never written
    into the job's spec: a later admission may choose other flavors)."""

    node_labels: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    flavors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Admission:
    """What Kueue says about one job, read from its Workload (None: none exists yet)."""

    queue: str
    workload: str
    exists: bool = False
    reserved: bool = False  # QuotaReserved=True: the quota is taken
    admitted: bool = False  # Admitted=True
    finished: bool = False
    deleting: bool = False
    stale: bool = False  # its pod sets or queue no longer match the job's
    evicted: tuple[str, str] | None = None  # (reason, message) of Evicted=True
    preempted: tuple[str, str] | None = None  # (reason, message) of Preempted=True
    pending: tuple[str, str] = ("", "")  # why it waits: QuotaReserved=False's reason, message
    cluster_queue: str = ""
    placement: Mapping[str, Placement] = field(default_factory=dict)  # by role
    problem: str = ""  # why it cannot be queued at all (no Kueue, an unknown priority class)

    @property
    def may_run(self) -> bool:
        """Pods may run: admitted, not evicted, and the Workload is the job's as it is."""
        return (
            self.exists
            and self.admitted
            and self.evicted is None
            and not self.deleting
            and not self.stale
            and not self.finished
            and not self.problem
        )

    def flavors(self) -> str:
        names = sorted({f for p in self.placement.values() for f in p.flavors})
        return ", ".join(names)


def flavor_names(wl: Mapping[str, Any]) -> set[str]:
    """Every ResourceFlavor an admitted Workload's pod sets were assigned."""
    admission = (wl.get("status") or {}).get("admission") or {}
    return {
        str(f)
        for a in admission.get("podSetAssignments") or []
        for f in (a.get("flavors") or {}).values()
    }


def admission(
    job: Mapping[str, Any],
    wl: Mapping[str, Any] | None,
    *,
    desired: Mapping[str, Any],
    flavors: Mapping[str, Mapping[str, Any]] | None = None,
    problem: str = "",
) -> Admission:
    """What `wl` (the job's Workload, or None) says, against the Workload the job wants now;
    `flavors`: the ResourceFlavors it was assigned, by name (their `spec`s)."""
    base = Admission(queue=queue_name(job) or "", workload=workload_name(job), problem=problem)
    if wl is None:
        return base
    status = wl.get("status") or {}
    evicted = condition(wl, "Evicted")
    preempted = condition(wl, "Preempted")
    waiting = condition(wl, "QuotaReserved", "False") or {}
    assigned = status.get("admission") or {}
    placement: dict[str, Placement] = {}
    for a in assigned.get("podSetAssignments") or []:
        names = tuple(sorted({str(f) for f in (a.get("flavors") or {}).values()}))
        labels: dict[str, str] = {}
        tolerations: list[Mapping[str, Any]] = []
        for name in names:
            flavor = (flavors or {}).get(name) or {}
            labels.update({str(k): str(v) for k, v in (flavor.get("nodeLabels") or {}).items()})
            tolerations += [t for t in flavor.get("tolerations") or [] if t not in tolerations]
        placement[str(a.get("name"))] = Placement(labels, tuple(tolerations), names)
    return Admission(
        queue=base.queue,
        workload=str(wl["metadata"]["name"]),
        exists=True,
        reserved=condition(wl, "QuotaReserved") is not None,
        admitted=condition(wl, "Admitted") is not None,
        finished=condition(wl, "Finished") is not None,
        deleting=bool(wl["metadata"].get("deletionTimestamp")),
        stale=stale(wl, desired),
        evicted=(str(evicted.get("reason", "")), str(evicted.get("message", "")))
        if evicted
        else None,
        preempted=(str(preempted.get("reason", "")), str(preempted.get("message", "")))
        if preempted
        else None,
        pending=(str(waiting.get("reason", "")), str(waiting.get("message", ""))),
        cluster_queue=str(assigned.get("clusterQueue") or ""),
        placement=placement,
        problem=problem,
    )


_SUFFIXES = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("", 0))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]{0,2})$")


def _quantity(text: str) -> str | None:
    """A Kubernetes quantity as one canonical number ("0.5", "500m" -> "0.5"), else None."""
    found = _QUANTITY.match(text)
    if found is None or found.group(2) not in _SUFFIXES:
        return None
    try:
        value = Decimal(found.group(1)) * _SUFFIXES[found.group(2)]
    except InvalidOperation:
        return None
    return format(value.normalize(), "f")


def _pruned(value: Any, *, quantities: bool = False) -> Any:
    """`value` without empty parts, its leaves as text and the quantities under `resources`
    and `overhead` as numbers: what the API server and Kueue (which decodes into Go types
    and encodes again: "1024Mi" comes back "1Gi") add or rewrite compares equal."""
    if isinstance(value, Mapping):
        out = {
            str(k): _pruned(v, quantities=quantities or k in ("resources", "overhead"))
            for k, v in value.items()
        }
        return {k: v for k, v in out.items() if v not in (None, {}, [], "")}
    if isinstance(value, list | tuple):
        return [_pruned(v, quantities=quantities) for v in value]
    if value is None:
        return None
    text = str(value)
    return (_quantity(text) or text) if quantities else text


def stale(wl: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether the Workload's pod sets or queue are no longer the job's."""
    spec, want = wl.get("spec") or {}, desired["spec"]
    return bool(
        _pruned(spec.get("podSets")) != _pruned(want["podSets"])
        or spec.get("queueName") != want["queueName"]
    )


def place(pod: dict[str, Any], placement: Placement | None, role: str) -> dict[str, Any]:
    """`pod` (a manifest of `builders.pod`) with its pod set's node labels and tolerations
    merged in (`podset.Merge`: the flavor's labels win) and the pod set's label."""
    pod["metadata"].setdefault("labels", {})[PODSET_LABEL] = role
    if placement is None:
        return pod
    spec = pod["spec"]
    if placement.node_labels:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_labels}
    if placement.tolerations:
        have = spec.setdefault("tolerations", [])
        have += [dict(t) for t in placement.tolerations if t not in have]
    return pod


# --- keeping the Workload true -------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One write: `create` a Workload, `update` its spec or metadata, write its `status`, or
    `delete` it; `body` is the whole object to send (guarded by its resourceVersion)."""

    verb: str  # create, update, status, delete
    body: dict[str, Any]
    why: str


def _set(
    conditions: list[dict[str, Any]],
    type_: str,
    value: bool,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int,
) -> None:
    wanted = "True" if value else "False"
    new = {
        "type": type_,
        "status": wanted,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": stamp(now),
        "observedGeneration": generation,
    }
    for i, c in enumerate(conditions):
        if c.get("type") == type_:
            if c.get("status") == wanted:
                new["lastTransitionTime"] = c.get("lastTransitionTime", new["lastTransitionTime"])
            conditions[i] = new
            return
    conditions.append(new)


def released(wl: Mapping[str, Any], *, now: datetime) -> dict[str, Any]:
    """`wl` with its reservation given back after an eviction, as Kueue's reconciler does it
    (step 6: `SetRequeuedCondition`, `UnsetQuotaReservationWithCondition`)."""
    out = copy.deepcopy(dict(wl))
    status = out.setdefault("status", {})
    conditions: list[dict[str, Any]] = status.setdefault("conditions", [])
    generation = int(out["metadata"].get("generation", 1))
    reason, message = "", ""
    evicted = condition(wl, "Evicted")
    if evicted:
        reason, message = str(evicted.get("reason", "")), str(evicted.get("message", ""))
    _set(
        conditions,
        "Requeued",
        reason in REQUEUED_ON,
        reason or "Evicted",
        message,
        now=now,
        generation=generation,
    )
    _set(conditions, "QuotaReserved", False, "Pending", message, now=now, generation=generation)
    _set(
        conditions,
        "Admitted",
        False,
        "NoReservation",
        "The workload has no reservation",
        now=now,
        generation=generation,
    )
    status.pop("admission", None)
    # every pod starts again at the next admission, finished workers included
    status.pop("reclaimablePods", None)
    return out


def actions(
    job: Mapping[str, Any],
    *,
    state: str,
    wl: Mapping[str, Any] | None,
    desired: Mapping[str, Any],
    pods: Sequence[PodState],
    now: datetime,
) -> list[Action]:
    """The writes that bring the job's Workload in line, given the job's `state` after this
    pass and its pods as observed at its start (pods this pass deleted count as still there:
    the reservation is given back on a later pass, once they are gone)."""
    finished = state in ("Succeeded", "Failed")
    active = [p for p in pods if p.phase in ("Pending", "Running") or p.deleting]
    if wl is None:
        if finished or active:
            return []  # a finished job needs no quota; a running one stops first (planner)
        return [Action("create", copy.deepcopy(dict(desired)), "the job asks for a queue")]
    meta = wl["metadata"]
    has_finalizer = FINALIZER in (meta.get("finalizers") or [])
    if meta.get("deletionTimestamp"):
        if has_finalizer and (finished or not active):
            return [release_finalizer(wl, "deleted, and the job's pods are gone")]
        return []
    out: list[Action] = []
    if finished:
        if condition(wl, "Finished") is None:
            body = copy.deepcopy(dict(wl))
            conditions = body.setdefault("status", {}).setdefault("conditions", [])
            message = _message(job)
            _set(
                conditions,
                "Finished",
                True,
                state,
                message,
                now=now,
                generation=int(meta.get("generation", 1)),
            )
            out.append(Action("status", body, f"the job {state.lower()}"))
        elif has_finalizer:
            out.append(release_finalizer(wl, "the job finished"))
        return out
    reserved = condition(wl, "QuotaReserved") is not None
    spec = wl.get("spec") or {}
    if stale(wl, desired):
        if not reserved:
            body = copy.deepcopy(dict(wl))
            body["spec"].update(
                podSets=desired["spec"]["podSets"], queueName=desired["spec"]["queueName"]
            )
            return [Action("update", body, "the job's pod sets or queue changed")]
        if not active:
            return [Action("delete", copy.deepcopy(dict(wl)), "the job changed while admitted")]
        return []  # its pods are being stopped (planner); then it is replaced
    if bool(spec.get("active", True)) != bool(desired["spec"]["active"]):
        body = copy.deepcopy(dict(wl))
        body["spec"]["active"] = desired["spec"]["active"]
        suspended = str(not body["spec"]["active"]).lower()
        out.append(Action("update", body, f"runPolicy.suspend is {suspended}"))
    if condition(wl, "Evicted") is not None and reserved and not active:
        out.append(Action("status", released(wl, now=now), "evicted, and its pods are gone"))
    elif reserved:
        reclaim = _reclaimable(job, wl, pods, desired=desired)
        if reclaim is not None:
            body = copy.deepcopy(dict(wl))
            body["status"]["reclaimablePods"] = reclaim
            out.append(Action("status", body, "replicas done for good release their quota"))
    return out


class UnavailableError(Exception):
    """Kueue's API is not served (its CRDs are not installed): jobs in a queue wait."""


def release_finalizer(wl: Mapping[str, Any], why: str) -> Action:
    """The update that removes jaxps's finalizer from a Workload."""
    body = copy.deepcopy(dict(wl))
    body["metadata"]["finalizers"] = [
        f for f in body["metadata"].get("finalizers") or [] if f != FINALIZER
    ]
    return Action("update", body, why)


def _message(job: Mapping[str, Any]) -> str:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True":
            return str(c.get("message") or "")
    return ""


def _reclaimable(
    job: Mapping[str, Any],
    wl: Mapping[str, Any],
    pods: Sequence[PodState],
    *,
    desired: Mapping[str, Any],
) -> list[dict[str, Any]] | None:
    """The new `status.reclaimablePods`, or None when it stays: per reclaimable role, its pods
    that Succeeded, never fewer than already reported (Kueue refuses a decrease) nor more than
    the pod set's count. A worker that left in a scale-down is not done for good (a scale-up
    brings its index back), so only the pods of the workers the job runs now count."""
    counts = {str(s["name"]): int(s["count"]) for s in desired["spec"]["podSets"]}
    running = builders.replicas(job)
    before = {
        str(r["name"]): int(r["count"])
        for r in (wl.get("status") or {}).get("reclaimablePods") or []
    }
    now = dict(before)
    for role in RECLAIMABLE:
        if role not in counts:
            continue
        done = sum(
            1
            for p in pods
            if p.role == role
            and p.phase == "Succeeded"
            and not p.deleting
            and p.index < running.get(role, 0)
        )
        now[role] = min(max(done, before.get(role, 0)), counts[role])
    now = {role: n for role, n in now.items() if n > 0}
    if now == {r: n for r, n in before.items() if n > 0}:
        return None
    return [{"name": role, "count": n} for role, n in sorted(now.items())]
