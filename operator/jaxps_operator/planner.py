"""The planner: what a TrainingJob's children should be, and what to do about them.

    plan(job, observed, now) -> Plan(create, delete, status, events, requeue_after, delete_job)

A pure function, with no client and no I/O: the kopf handlers and `jaxps local` only carry
Plans out. It is level-based: from the job (defaults applied, status included) and the pods
that exist, it computes the whole desired status and the actions that converge to it, so
running it twice on the same input gives the same Plan.

Rules (DESIGN.md section 4; where TFJob hurts, see research/tfjob-anchor.md):
- children: one headless Service named after the job (`publishNotReadyAddresses`) and one pod
  per task, `<job>-<role>-<index>`, with hostname/subdomain, labels, port 2222, a metrics port
  (9090, or the template's port named `metrics`), TF_CONFIG and the JAXPS_* environment, pod
  `restartPolicy: Never`;
- a failed pod is replaced (same name) when its role's policy says so: OnFailure and Always
  always, ExitCode for exit codes >= 128, Never never. TensorFlow's tasks can exit 0 mid-job;
  jaxps tasks exit 0 only once training is over (a ps when the chief shuts it down), so
  Always acts as OnFailure: a pod that exited 0 is done; every replacement is counted in
  `status.restarts`, and past `runPolicy.backoffLimit` the job fails (BackoffLimitExceeded);
  a pod is never recreated while its predecessor is still terminating, and the job stays
  Restarting until every pod runs again;
- success: the chief (or worker 0) succeeded (`successPolicy: chief`), or every worker did
  (`allWorkers`); failure: a pod failed that may not be replaced (ReplicaFailed, naming role,
  index and exit code), the backoff limit, or `activeDeadlineSeconds` (DeadlineExceeded), with
  a real requeue at the deadline;
- once finished, `cleanPodPolicy` (Running by default: no ps outlives its job) and
  `ttlSecondsAfterFinished` (a real requeue, then the job is deleted);
- `suspend` deletes the running pods and creates none until resumed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from jaxps_runtime import cluster

ROLES = ("chief", "ps", "worker", "evaluator")
PORT = 2222
METRICS_PORT = 9090
# The operator's --runtime-image overrides it. Never `:latest`: that tag makes the kubelet pull
# on every start, which fails on nodes that load images without a registry.
DEFAULT_IMAGE = "ghcr.io/jaxps/runtime:0.1.0"
LABEL_JOB, LABEL_ROLE, LABEL_INDEX = (
    "jaxps.dev/job-name",
    "jaxps.dev/replica-type",
    "jaxps.dev/replica-index",
)
RETRYABLE_EXIT_CODE = 128  # ExitCode policy: codes from here on (signals, OOM) are retried
TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class PodState:
    """What is observed of one pod."""

    name: str
    role: str
    index: int
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    ready: bool = False
    exit_code: int | None = None
    reason: str = ""
    deleting: bool = False


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass
class Plan:
    """What to do: the backend carries it out as it is, in order: delete, then create."""

    create: list[dict[str, Any]] = field(default_factory=list)  # Service and pod manifests
    delete: list[str] = field(default_factory=list)  # pod names
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None  # seconds until the next timer (deadline, TTL)
    delete_job: bool = False


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def _stamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def replicas(job: Mapping[str, Any]) -> dict[str, int]:
    specs = job["spec"]["replicaSpecs"]
    return {
        role: int(specs[role]["replicas"])
        for role in ROLES
        if role in specs and int(specs[role]["replicas"]) > 0
    }


def pod_name(job: Mapping[str, Any], role: str, index: int) -> str:
    return cluster.pod_name(job=job["metadata"]["name"], role=role, index=index)


def chief_task(job: Mapping[str, Any]) -> tuple[str, int]:
    return ("chief", 0) if "chief" in replicas(job) else ("worker", 0)


def cluster_addresses(job: Mapping[str, Any]) -> dict[str, list[str]]:
    name = job["metadata"]["name"]
    namespace = job["metadata"].get("namespace", "default")
    return {
        role: [
            cluster.dns_address(job=name, role=role, index=i, namespace=namespace, port=PORT)
            for i in range(n)
        ]
        for role, n in replicas(job).items()
    }


def training_json(job: Mapping[str, Any]) -> str:
    return json.dumps(job["spec"]["training"], sort_keys=True)


# --- children ----------------------------------------------------------------------------------


def _labels(
    job: Mapping[str, Any], role: str | None = None, index: int | None = None
) -> dict[str, str]:
    labels = {LABEL_JOB: job["metadata"]["name"]}
    if role is not None:
        labels[LABEL_ROLE] = role
    if index is not None:
        labels[LABEL_INDEX] = str(index)
    return labels


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": job.get("apiVersion", "jaxps.dev/v1alpha1"),
        "kind": "TrainingJob",
        "name": job["metadata"]["name"],
        "uid": job["metadata"].get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def service(job: Mapping[str, Any]) -> dict[str, Any]:
    """The headless Service that gives every pod `<pod>.<job>.<ns>.svc`."""
    name = job["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "labels": _labels(job),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _labels(job),
            "ports": [{"name": "grpc", "port": PORT, "targetPort": PORT}],
        },
    }


def metrics_port(container: Mapping[str, Any]) -> int:
    """The container's port named `metrics` (a template may choose it), else 9090."""
    for port in container.get("ports") or []:
        if port.get("name") == "metrics" and port.get("containerPort"):
            return int(port["containerPort"])
    return METRICS_PORT


def pod(
    job: Mapping[str, Any], role: str, index: int, *, image: str = DEFAULT_IMAGE
) -> dict[str, Any]:
    """The pod of one task: its template, plus what jaxps needs; `image` unless it names one."""
    spec = job["spec"]
    template = copy.deepcopy(spec["replicaSpecs"][role].get("template") or {})
    pod_spec = template.setdefault("spec", {})
    containers = pod_spec.setdefault("containers", [])
    if not containers:
        containers.append({"name": "jaxps"})
    main = containers[0]
    main.setdefault("name", "jaxps")
    main.setdefault("image", image)
    main.setdefault("command", ["python", "-m", "jaxps_runtime"])
    name = pod_name(job, role, index)
    metrics = metrics_port(main)
    env = [
        e
        for e in main.get("env", [])
        if not str(e.get("name", "")).startswith(("TF_CONFIG", "JAXPS_"))
    ]
    env += [
        {
            "name": "TF_CONFIG",
            "value": cluster.build_tf_config(
                cluster=cluster_addresses(job), task_type=role, task_index=index
            ),
        },
        {"name": "JAXPS_TRAINING", "value": training_json(job)},
        {"name": "JAXPS_JOB_NAME", "value": job["metadata"]["name"]},
        {"name": "JAXPS_JOB_UID", "value": job["metadata"].get("uid") or job["metadata"]["name"]},
        {"name": "JAXPS_METRICS_PORT", "value": str(metrics)},
    ]
    main["env"] = env
    ports = [
        p
        for p in main.get("ports", [])
        if p.get("name") not in ("grpc", "metrics")
        and p.get("containerPort") not in (PORT, metrics)
    ]
    main["ports"] = [
        *ports,
        {"name": "grpc", "containerPort": PORT},
        {"name": "metrics", "containerPort": metrics},
    ]
    checkpoint = spec["training"].get("checkpoint") or {}
    if checkpoint.get("claimName"):
        pod_spec.setdefault("volumes", []).append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint["claimName"]}}
        )
        main.setdefault("volumeMounts", []).append(
            {"name": "checkpoints", "mountPath": checkpoint["dir"]}
        )
    pod_spec["restartPolicy"] = "Never"
    pod_spec["hostname"] = name
    pod_spec["subdomain"] = job["metadata"]["name"]
    metadata = template.setdefault("metadata", {})
    metadata["name"] = name
    metadata["labels"] = {**metadata.get("labels", {}), **_labels(job, role, index)}
    metadata["ownerReferences"] = [owner_reference(job)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


# --- status ------------------------------------------------------------------------------------


def _condition(
    status: dict[str, Any],
    *,
    type_: str,
    value: bool,
    reason: str,
    message: str,
    now: datetime,
    generation: int,
) -> None:
    """Sets a condition; lastTransitionTime changes only when the status does."""
    conditions: list[dict[str, Any]] = status.setdefault("conditions", [])
    wanted = "True" if value else "False"
    for c in conditions:
        if c["type"] == type_:
            if c["status"] != wanted:
                c["lastTransitionTime"] = _stamp(now)
            c.update(status=wanted, reason=reason, message=message, observedGeneration=generation)
            return
    if value:
        conditions.append(
            {
                "type": type_,
                "status": wanted,
                "reason": reason,
                "message": message,
                "lastTransitionTime": _stamp(now),
                "observedGeneration": generation,
            }
        )


def _marker(status: dict[str, Any], *, now: datetime, generation: int) -> Any:
    """`mark(type, value, reason, message)`: `_condition` bound to one status and pass."""

    def mark(type_: str, value: bool, reason: str, message: str) -> None:
        _condition(
            status,
            type_=type_,
            value=value,
            reason=reason,
            message=message,
            now=now,
            generation=generation,
        )

    return mark


def _is_true(status: Mapping[str, Any], type_: str) -> bool:
    return any(c["type"] == type_ and c["status"] == "True" for c in status.get("conditions", []))


def _may_replace(policy: str, exit_code: int | None) -> bool:
    if policy in ("OnFailure", "Always"):
        return True
    if policy == "ExitCode":
        return exit_code is None or exit_code >= RETRYABLE_EXIT_CODE
    return False


def _finish(
    plan: Plan,
    status: dict[str, Any],
    *,
    succeeded: bool,
    reason: str,
    message: str,
    now: datetime,
    generation: int,
) -> None:
    mark = _marker(status, now=now, generation=generation)
    mark("Succeeded" if succeeded else "Failed", True, reason, message)
    for other in ("Running", "Restarting", "PodsReady"):
        if _is_true(status, other):
            mark(other, False, reason, message)
    status["completionTime"] = _stamp(now)
    plan.events.append(Event("Normal" if succeeded else "Warning", reason, message))


def plan(
    job: Mapping[str, Any],
    observed: Sequence[PodState],
    now: datetime,
    *,
    service_exists: bool = True,
    image: str = DEFAULT_IMAGE,
) -> Plan:
    """The Plan for `job` (validated, defaults applied) given its pods at `now` (aware UTC)."""
    out = Plan()
    generation = int(job["metadata"].get("generation", 1))
    status: dict[str, Any] = copy.deepcopy(dict(job.get("status") or {}))
    status["observedGeneration"] = generation
    mark = _marker(status, now=now, generation=generation)
    wanted = replicas(job)
    name = job["metadata"]["name"]
    pods = {(p.role, p.index): p for p in observed}
    counts = {
        role: {
            "pending": 0,
            "active": 0,
            "ready": 0,
            "succeeded": 0,
            "failed": 0,
            "restarts": int((status.get("replicaStatuses") or {}).get(role, {}).get("restarts", 0)),
        }
        for role in wanted
    }
    for p in observed:
        if p.role in counts:
            c = counts[p.role]
            c["pending"] += p.phase == "Pending"
            c["active"] += p.phase == "Running"
            c["ready"] += p.phase == "Running" and p.ready
            c["succeeded"] += p.phase == "Succeeded"
            c["failed"] += p.phase == "Failed"
    status["replicaStatuses"] = counts
    total = sum(wanted.values())
    status["readyReplicas"] = f"{sum(c['ready'] for c in counts.values())}/{total}"
    status.setdefault("restarts", 0)

    if not status.get("conditions"):
        mark("Created", True, "JobCreated", f"TrainingJob {name} created: {total} pods")
        out.events.append(Event("Normal", "JobCreated", f"created TrainingJob {name}"))

    finished = _is_true(status, "Succeeded") or _is_true(status, "Failed")
    if not finished:
        _run(
            job,
            out,
            status,
            pods=pods,
            wanted=wanted,
            now=now,
            generation=generation,
            service_exists=service_exists,
            image=image,
        )
        finished = _is_true(status, "Succeeded") or _is_true(status, "Failed")
    if finished:
        _clean_up(job, out, observed, status, now=now)

    status["state"] = _state(status)
    out.status = status
    return out


def _run(
    job: Mapping[str, Any],
    out: Plan,
    status: dict[str, Any],
    *,
    pods: dict[tuple[str, int], PodState],
    wanted: dict[str, int],
    now: datetime,
    generation: int,
    service_exists: bool,
    image: str,
) -> None:
    mark = _marker(status, now=now, generation=generation)
    spec, run = job["spec"], job["spec"]["runPolicy"]
    name = job["metadata"]["name"]

    if run["suspend"]:
        if not _is_true(status, "Suspended"):
            mark(
                "Suspended",
                True,
                "JobSuspended",
                "runPolicy.suspend is true: pods deleted, none created",
            )
            out.events.append(Event("Normal", "JobSuspended", f"suspended {name}"))
        for key in ("Running", "PodsReady"):
            if _is_true(status, key):
                mark(key, False, "JobSuspended", "suspended")
        out.delete += [p.name for p in pods.values() if not p.deleting]
        return
    if _is_true(status, "Suspended"):
        mark("Suspended", False, "JobResumed", "runPolicy.suspend is false: pods created again")
        status.pop("startTime", None)  # the deadline counts from the resume
        out.events.append(Event("Normal", "JobResumed", f"resumed {name}"))

    status.setdefault("startTime", _stamp(now))
    deadline = run.get("activeDeadlineSeconds")
    if deadline:
        started = _time(status["startTime"])
        assert started is not None
        left = (started + timedelta(seconds=deadline) - now).total_seconds()
        if left <= 0:
            _finish(
                out,
                status,
                succeeded=False,
                reason="DeadlineExceeded",
                message=f"the job was active longer than runPolicy.activeDeadlineSeconds "
                f"({deadline} s)",
                now=now,
                generation=generation,
            )
            return
        out.requeue_after = left

    if not service_exists:
        out.create.append(service(job))

    restarting: list[str] = []
    for role, count in wanted.items():
        policy = spec["replicaSpecs"][role]["restartPolicy"]
        for index in range(count):
            p = pods.get((role, index))
            task = f"{role} {index}"
            if p is None:
                out.create.append(pod(job, role, index, image=image))
                continue
            if p.deleting:
                restarting.append(task)  # recreated once it is gone, never before
                continue
            if p.phase == "Failed":
                code = p.exit_code
                if p.phase == "Failed" and not _may_replace(policy, code):
                    why = f"exit code {code}" if code is not None else f"reason {p.reason or '?'}"
                    _finish(
                        out,
                        status,
                        succeeded=False,
                        reason="ReplicaFailed",
                        message=f"{role} {index} (pod {p.name}) failed with {why}; its "
                        f"restartPolicy is {policy}",
                        now=now,
                        generation=generation,
                    )
                    return
                status["restarts"] += 1
                status["replicaStatuses"][role]["restarts"] += 1
                if status["restarts"] > run["backoffLimit"]:
                    _finish(
                        out,
                        status,
                        succeeded=False,
                        reason="BackoffLimitExceeded",
                        message=f"{status['restarts']} pod replacements exceed "
                        f"runPolicy.backoffLimit ({run['backoffLimit']}); the last: "
                        f"{role} {index} exit code {code}",
                        now=now,
                        generation=generation,
                    )
                    return
                out.delete.append(p.name)
                restarting.append(task)
                out.events.append(
                    Event(
                        "Warning",
                        "PodReplaced",
                        f"{role} {index} (pod {p.name}) failed with exit code "
                        f"{code}; replacing it (restartPolicy {policy})",
                    )
                )

    if _succeeded(job, pods):
        who = (
            "every worker"
            if spec["successPolicy"] == "allWorkers"
            else "{} {}".format(*chief_task(job))
        )
        _finish(
            out,
            status,
            succeeded=True,
            reason="JobSucceeded",
            message=f"{who} succeeded",
            now=now,
            generation=generation,
        )
        return
    if restarting:
        mark("Restarting", True, "PodReplaced", f"replacing {', '.join(restarting)}")
    elif _is_true(status, "Restarting") and all(
        (p := pods.get((role, index))) is not None and p.phase in ("Running", "Succeeded")
        for role, count in wanted.items()
        for index in range(count)
    ):
        mark("Restarting", False, "PodsReplaced", "every replaced pod is running again")
    role, index = chief_task(job)
    chief = pods.get((role, index))
    if (
        chief is not None
        and chief.phase == "Running"
        and not chief.deleting
        and not _is_true(status, "Running")
    ):
        mark("Running", True, "JobRunning", f"{role} {index} is running")
        out.events.append(Event("Normal", "JobRunning", f"{name} is running"))
    everyone = sum(wanted.values())
    ready = sum(1 for p in pods.values() if p.phase == "Running" and p.ready and not p.deleting)
    if ready == everyone and not _is_true(status, "PodsReady"):
        mark("PodsReady", True, "PodsReady", f"all {everyone} pods are running and ready")
    elif ready < everyone and _is_true(status, "PodsReady"):
        mark("PodsReady", False, "PodsNotReady", f"{ready} of {everyone} pods ready")


def _succeeded(job: Mapping[str, Any], pods: Mapping[tuple[str, int], PodState]) -> bool:
    if job["spec"]["successPolicy"] == "allWorkers":
        workers = replicas(job)["worker"]
        return all(
            (p := pods.get(("worker", i))) is not None and p.phase == "Succeeded"
            for i in range(workers)
        )
    chief = pods.get(chief_task(job))
    return chief is not None and chief.phase == "Succeeded" and (chief.exit_code or 0) == 0


def _clean_up(
    job: Mapping[str, Any],
    out: Plan,
    observed: Sequence[PodState],
    status: dict[str, Any],
    *,
    now: datetime,
) -> None:
    run = job["spec"]["runPolicy"]
    policy = run["cleanPodPolicy"]
    for p in observed:
        if p.deleting or p.name in out.delete:
            continue
        if policy == "All" or (
            policy == "Running" and p.phase in ("Pending", "Running", "Unknown")
        ):
            out.delete.append(p.name)
    out.create = []  # nothing new for a finished job
    ttl = run.get("ttlSecondsAfterFinished")
    completed = _time(status.get("completionTime"))
    if ttl is not None and completed is not None:
        left = (completed + timedelta(seconds=ttl) - now).total_seconds()
        if left <= 0:
            out.delete_job = True
        else:
            out.requeue_after = left
    elif out.requeue_after is not None:
        out.requeue_after = None  # no deadline once finished


def _state(status: Mapping[str, Any]) -> str:
    for type_ in ("Failed", "Succeeded", "Suspended", "Restarting", "Running"):
        if _is_true(status, type_):
            return type_
    return "Created"
