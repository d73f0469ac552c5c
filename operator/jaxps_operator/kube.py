"""The Kubernetes adapter of the `Cluster` port: the API server, through the official client.

Every call here blocks on the network: the controller makes them from its worker threads, never
from a watch's thread. Creating an object that already exists (409) and deleting one that
is gone (404) count as success: children have deterministic names and a pass may be repeated.
A task's progress is read from its pod IP and its container port named `metrics`; its final
summary is its container's termination message.

A pass reads a job's pods from kopf's index of the pod watch (`pod_index`), not with a LIST of
its own (a LIST per pass was most of the operator's CPU, and of its latency from a pod's phase
to the job's status). The pods a pass created or deleted are seen by the next pass at once,
before their watch events come: a created pod as the API server answered it, a deleted one as
deleting (`pod_event` forgets each once the watch has spoken of it). Until kopf hands over its
index (at start-up), passes LIST.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from jaxps_operator import builders, capacity, issuer, progress
from jaxps_operator.conditions import Event, parse_time
from jaxps_operator.kubeclient import Api, ApiError, message_of
from jaxps_operator.objects import FOREIGN, INITIALIZING, PodState
from jaxps_operator.reconcile import Children, ConflictError, NameTakenError, RefusedError

__all__ = [
    "ApiError",
    "ConflictError",
    "KubeCluster",
    "message",
    "pod_state",
    "slim_pod",
    "waiting",
]

GROUP, VERSION, PLURAL, KIND = "jaxps.dev", "v1alpha1", "trainingjobs", "TrainingJob"
API = f"{GROUP}/{VERSION}"  # the TrainingJob API, as a path's group or an apiVersion
COMPONENT = "jaxps-operator"
log = logging.getLogger("jaxps.operator")

# A job's Secret, NetworkPolicy and Service, once read as there, are read again only this long
# after, in the background (a pass per pod event read them all each time): one deleted by hand
# is made again by the pass that follows the first read after it.
KEPT_FOR = 30.0
NODE_READ_SECONDS = 5.0
"""A node's readiness is read again after this: one GET per node, not per pod or pass."""
KEPT_MAX = 10_000
GONE_MAX = 10_000  # pods whose deletion is remembered (against late events)


def message(err: ApiError) -> str:
    """The apiserver's own words for a refused request."""
    return message_of(err)


def _version(obj: Mapping[str, Any]) -> int | None:
    try:
        return int((obj.get("metadata") or {})["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


def _newer(job: Mapping[str, Any], than: Mapping[str, Any] | None) -> bool:
    """Whether `job` is a later version of the same object than `than` (etcd's resource
    versions grow; one that is no number is taken as later)."""
    if than is None:
        return True
    if (job.get("metadata") or {}).get("uid") != than["metadata"].get("uid"):
        return True
    new, old = _version(job), _version(than)
    return new is None or old is None or new > old


def namespaced(namespace: str, plural: str, name: str = "", *, group: str = "") -> str:
    """The path of a namespaced collection or object: core when `group` is '' (v1)."""
    base = f"/apis/{group}" if group else "/api/v1"
    return f"{base}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


# A container waits for these on its normal way to running; any other waiting reason
# (ErrImagePull, ImagePullBackOff, CreateContainerConfigError, ...) is a problem to report.
STARTING = ("ContainerCreating", "PodInitializing")
STARTING_QUIET_SECONDS = 5.0
"""How long a scheduled pod starts before the kubelet's Warnings on it are read."""
# the kubelet's Warnings on a pod that does not start, and the reason the job says for each
KUBELET_WARNINGS = {
    "FailedMount": "MountFailed",
    "FailedAttachVolume": "MountFailed",
    "FailedMapVolume": "MountFailed",
    "FailedCreatePodSandBox": "SandboxFailed",
}


def waiting(pod: Mapping[str, Any], main: Mapping[str, Any]) -> tuple[str, str]:
    """Why a pod whose jaxps container does not run yet waits, as (reason, message): the
    scheduler's PodScheduled=False (Unschedulable: `0/1 nodes are available: 1 Insufficient
    cpu`), else an init container of the user's that failed to start or has not finished
    (native sidecars, restartPolicy Always, run on), else the jaxps container's waiting
    reason unless it is on its normal way; ("", "") when it waits for nothing said yet."""
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return str(c.get("reason") or "Unschedulable"), str(c.get("message") or "")
    sidecars = {
        c.get("name")
        for c in (pod.get("spec") or {}).get("initContainers") or []
        if c.get("restartPolicy") == "Always"
    }
    for container in status.get("initContainerStatuses") or []:
        name = container.get("name")
        state = container.get("state") or {}
        if name in sidecars:
            continue
        said = state.get("waiting") or {}
        if said.get("reason") and said["reason"] not in STARTING:
            return str(said["reason"]), f"init container {name!r}: {said.get('message') or ''}"
        if "running" in state:
            since = (state["running"] or {}).get("startedAt") or "?"
            return INITIALIZING, f"init container {name!r} has run since {since} and not finished"
    for container in status.get("containerStatuses") or []:
        if container.get("name") != main.get("name"):
            continue
        state = (container.get("state") or {}).get("waiting") or {}
        reason = str(state.get("reason") or "")
        if reason and reason not in STARTING:
            return reason, str(state.get("message") or "")
    return "", ""


def _not_started(pod: Mapping[str, Any], main: Mapping[str, Any]) -> bool:
    """Whether the pod's jaxps container has neither run nor ended yet."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        if container.get("name") == main.get("name"):
            state = container.get("state") or {}
            return not ("running" in state or "terminated" in state)
    return True


def pod_state(pod: Mapping[str, Any], owner_uid: str) -> PodState | None:
    """What the planner needs of a pod; pods of another job with the same name count as leaving."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    try:
        role, index = labels[builders.LABEL_ROLE], int(labels[builders.LABEL_INDEX])
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    refs = meta.get("ownerReferences") or []
    owned = any(ref.get("uid") == owner_uid for ref in refs)
    # a TrainingJob's pod whose job went (same name, other uid) is the garbage collector's
    foreign = not owned and not meta.get("deletionTimestamp") and not _a_jobs(refs)
    main = builders.main_container(pod.get("spec") or {})
    terminated: Mapping[str, Any] = {}
    for container in status.get("containerStatuses") or []:
        if container.get("name") == main.get("name"):
            terminated = (container.get("state") or {}).get("terminated") or {}
    phase = status.get("phase", "Pending")
    # (not a pod being deleted: its containers end because it goes, whatever they exit with)
    lingering = (
        phase == "Running" and "exitCode" in terminated and not meta.get("deletionTimestamp")
    )
    if lingering:
        # the jaxps container ended while a sidecar of the user's still runs (restartPolicy
        # Never: it is not started again): its end is the task's, as a finished pod's would be
        phase = "Succeeded" if terminated["exitCode"] == 0 else "Failed"
    failed_init = ""
    if phase == "Failed" and not terminated:  # an init container failed: the main never ran
        for container in status.get("initContainerStatuses") or []:
            state = (container.get("state") or {}).get("terminated") or {}
            if state.get("exitCode"):
                terminated, failed_init = state, str(container.get("name") or "?")
                break
    ip = status.get("podIP")
    # counted until the jaxps container runs: a sidecar running makes the pod Running before
    why, words = (
        waiting(pod, main)
        if phase == "Pending" or (phase == "Running" and _not_started(pod, main))
        else ("", "")
    )
    limit = ((main.get("resources") or {}).get("limits") or {}).get("memory")
    return PodState(
        name=meta["name"],
        role=role,
        index=index,
        phase=phase,
        ready=any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        ),
        exit_code=terminated.get("exitCode"),
        reason=status.get("reason") or terminated.get("reason") or "",
        deleting=bool(meta.get("deletionTimestamp")) or not owned,
        message=terminated.get("message") or "",
        metrics=f"{ip}:{builders.template_metrics_port(main)}"
        if ip and phase == "Running"
        else None,
        container_reason=terminated.get("reason") or "",
        memory_limit=str(limit) if limit is not None else None,
        waiting_reason=why,
        waiting_message=words,
        created=parse_time(meta.get("creationTimestamp")),
        failed_init=failed_init,
        lingering=lingering,
        foreign=foreign,
        disruption=_disruption(status),
        starting=not why and phase == "Pending" and _scheduled(pod) and _not_started(pod, main),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        uid=str(meta.get("uid") or ""),
    )


def secret_changed(secret: Mapping[str, Any]) -> str:
    """How the job's Secret differs from what the operator made: "" when its data has the
    digest it was made with (`builders.DIGEST_ANNOTATION`), or it has none (made by an earlier
    operator, which gave none: an upgrade fails no running job)."""
    made = ((secret.get("metadata") or {}).get("annotations") or {}).get(builders.DIGEST_ANNOTATION)
    if made is not None and builders.secret_digest(secret.get("data") or {}) != made:
        return f"its data no longer has the digest it was made with ({builders.DIGEST_ANNOTATION})"
    return ""


def _not_ready(node: Mapping[str, Any]) -> tuple[str, datetime] | None:
    """A node's Ready condition when it is not True: "Ready=Unknown NodeStatusUnknown: Kubelet
    stopped posting node status.", and since when (None when Ready, or never said)."""
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") != "Ready":
            continue
        if c.get("status") == "True":
            return None
        since = parse_time(c.get("lastTransitionTime")) or datetime.now(UTC)
        said = f"Ready={c.get('status')} {c.get('reason') or ''}".rstrip()
        words = str(c.get("message") or "").strip()
        return (f"{said}: {words}" if words else said), since
    return None


def _disruption(status: Mapping[str, Any]) -> str:
    """The DisruptionTarget condition's reason and words when Kubernetes is ending the pod
    (the scheduler's preemption, the kubelet's eviction, a lost node's taint, the eviction API)."""
    for c in status.get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return f"{c.get('reason') or 'Disrupted'}: {c.get('message') or ''}".rstrip(": ")
    return ""


def liveness_kill(events: Sequence[Mapping[str, Any]], uid: str) -> str:
    """The kubelet's own word that it killed the container for its liveness probe (a Killing
    Event "... failed liveness probe ..."), with the probe's last failure (an Unhealthy Event),
    as "LivenessProbeFailed: <their words>"; "" when it did not (a probe that failed now and
    then, under its failureThreshold, or a container that died of something else)."""
    mine = [e for e in events if (e.get("involvedObject") or {}).get("uid") in (uid, None)]
    killed = [
        e
        for e in mine
        if e.get("reason") == "Killing" and "failed liveness probe" in str(e.get("message") or "")
    ]
    if not killed:
        return ""
    failures = [
        e
        for e in mine
        if e.get("reason") == "Unhealthy"
        and str(e.get("message") or "").startswith("Liveness probe failed")
    ]
    when = lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or "")  # noqa: E731
    said = (
        max(failures, key=when).get("message") if failures else max(killed, key=when).get("message")
    )
    return f"LivenessProbeFailed: {said}"


def _scheduled(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def kubelet_said(events: Sequence[Mapping[str, Any]], uid: str) -> tuple[str, str]:
    """The latest of the kubelet's Warnings (`KUBELET_WARNINGS`) among a pod's Events, as the
    job's reason and the kubelet's words; ("", "") when none (or only of another pod of the
    name: `uid`)."""
    said = [
        e
        for e in events
        if e.get("reason") in KUBELET_WARNINGS
        and (e.get("involvedObject") or {}).get("uid") in (uid, None)
    ]
    if not said:
        return "", ""
    last = max(said, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return KUBELET_WARNINGS[str(last["reason"])], f"{last['reason']}: {last.get('message') or ''}"


def _a_jobs(refs: list[Mapping[str, Any]]) -> bool:
    return any(ref.get("kind") == KIND and ref.get("controller") for ref in refs)


def foreign(found: Mapping[str, Any], job: Mapping[str, Any]) -> str | None:
    """Why an object with a name the job needs is not the job's, or None when it is (an
    ownerReference with the job's uid)."""
    meta = found.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    if any(ref.get("uid") == job["metadata"].get("uid") for ref in refs):
        return None
    owners = ", ".join(f"{r.get('kind')} {r.get('name')}" for r in refs) or "nothing"
    return f"{FOREIGN} (its owner: {owners})"


def slim_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What `pod_state` reads of a pod, and no more (a pod kept whole is ten times larger)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    main = builders.main_container(pod.get("spec") or {})
    return {
        "metadata": {
            k: meta[k]
            for k in (
                "name",
                "namespace",
                "uid",
                "labels",
                "resourceVersion",
                "deletionTimestamp",
                "creationTimestamp",
            )
            if k in meta
        }
        | {
            "ownerReferences": [
                {k: r[k] for k in ("uid", "kind", "controller") if k in r}
                for r in meta.get("ownerReferences") or []
            ]
        },
        "spec": {
            "containers": [
                {k: main[k] for k in ("name", "ports", "resources") if k in main},
            ],
            # native sidecars: init containers that run on (`waiting` passes them over)
            "initContainers": [
                {"name": c.get("name"), "restartPolicy": "Always"}
                for c in (pod.get("spec") or {}).get("initContainers") or []
                if c.get("restartPolicy") == "Always"
            ],
        }
        | (
            {"nodeName": spec["nodeName"]}
            if (spec := pod.get("spec") or {}).get("nodeName")
            else {}
        ),
        "status": {
            k: status[k]
            for k in (
                "phase",
                "podIP",
                "reason",
                "conditions",
                "containerStatuses",
                "initContainerStatuses",
            )
            if k in status
        },
    }


class KubeCluster:
    """The `Cluster` of one API server. Thread-safe."""

    def __init__(
        self,
        api: Api | None = None,
        *,
        network_policies: bool = True,
        pod_index: Callable[[str, str], list[dict[str, Any]]] | None = None,
    ) -> None:
        """`network_policies`: whether jobs get one (else they are never read: no RBAC).
        `pod_index(namespace, job)`: the job's pods as the pod watch has them (kopf's index,
        slimmed); None: LIST them."""
        self.network_policies = network_policies
        self._api = api
        self.pod_index = pod_index
        # (namespace, job): a child read as there is gone, the job wants a pass (`_kept`)
        self.on_gone: Callable[[str, str], None] = lambda namespace, name: None
        self.reads = ThreadPoolExecutor(4, thread_name_prefix="jaxps-read")
        # (namespace, name, uid) -> (until, the Secret's keys): see `_kept`
        self._known: dict[tuple[str, str, str], tuple[float, list[str]]] = {}
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], dict[str, Any]] = {}  # see `seen`
        # what this operator did that the watch has not said yet (`pods`, `pod_event`):
        # (namespace, job) -> pod name -> the pod it created, slimmed
        self._made: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        # (namespace, pod) -> (its uid, when this operator deleted it)
        self._deleted: dict[tuple[str, str], tuple[str, str]] = {}
        self._gone: dict[tuple[str, str], int] = {}  # (namespace, pod) -> version deleted at
        # node -> (until, why it is not Ready and since when, or None): see `_node_lost`
        self._nodes: dict[str, tuple[float, tuple[str, datetime] | None]] = {}
        self._nodes_unread = False

    @property
    def api(self) -> Api:
        if self._api is None:
            self._api = Api()
        return self._api

    # --- the port -----------------------------------------------------------------------------

    def children(self, job: Mapping[str, Any]) -> Children:
        meta = job["metadata"]
        namespace = meta["namespace"]
        keys = self._kept(job)
        taken: list[str] = []
        changed: list[str] = []
        if keys is None:  # read what is not known to exist: the Secret, NetworkPolicy, Service
            keys, network_policy, service = self._read_children(job, taken=taken, changed=changed)
            if keys is not None and network_policy and service and not changed:
                self._keep(meta, keys)
        else:
            service = network_policy = True
        uid = meta.get("uid", "")
        states = [
            self._on_lost_node(self._why_starting(namespace, s, p))
            for p in self.pods(namespace, meta["name"])
            if (s := pod_state(p, uid)) is not None
        ]
        return Children(
            pods=states,
            service=service,
            secret=keys is not None,
            network_policy=network_policy,
            issued_workers=capacity.issued_workers(keys, job) if keys is not None else None,
            taken=taken,
            secret_changed=changed[0] if changed else "",
        )

    def _on_lost_node(self, state: PodState) -> PodState:
        """A scheduled pod that is not ready (Kubernetes marks a lost node's pods so) on a node
        whose Ready condition is not True: that, and since when (`policy.node`)."""
        if state.ready or not state.node or state.phase not in ("Pending", "Running"):
            return state
        lost = self._node_lost(state.node)
        if lost is None:
            return state
        return dataclasses.replace(state, node_lost=lost[0], node_lost_since=lost[1])

    def _node_lost(self, name: str) -> tuple[str, datetime] | None:
        """Why node `name` is not Ready and since when; None when it is (or cannot be read: no
        RBAC for nodes). One GET per node every NODE_READ_SECONDS, whatever its pods."""
        now = time.monotonic()
        with self._lock:
            kept = self._nodes.get(name)
        if kept is not None and kept[0] > now:
            return kept[1]
        try:
            node = self.api.call("GET", f"/api/v1/nodes/{name}") or {}
        except ApiError as err:
            if err.status == 404:  # deleted: lost since it was first found gone
                since = kept[1][1] if kept is not None and kept[1] is not None else None
                lost = ("the node is deleted", since or datetime.now(UTC))
            else:
                if not self._nodes_unread:
                    log.warning("node %s not read (lost nodes go unnoticed): %s", name, err)
                self._nodes_unread = True
                lost = None
        else:
            lost = _not_ready(node)
        with self._lock:
            if len(self._nodes) > KEPT_MAX:
                self._nodes.clear()
            self._nodes[name] = (now + NODE_READ_SECONDS, lost)
        return lost

    def _why_starting(self, namespace: str, state: PodState, pod: Mapping[str, Any]) -> PodState:
        """What the kubelet said of a pod, where its status does not: a pod `starting` for
        `STARTING_QUIET_SECONDS` gets its Warning (a volume it cannot mount) as why it waits;
        a pod whose container was killed (exit 137 or 143, not for memory) its liveness
        probe's failure as what ended it. One LIST of the pod's Warning Events."""
        killed = (
            state.phase == "Failed"
            and state.exit_code in (137, 143)
            and not state.oom_killed
            and not state.disruption
            and not state.deleting
        )
        if not (state.starting or killed) or state.created is None:
            return state
        if state.starting and (
            (datetime.now(UTC) - state.created).total_seconds() < STARTING_QUIET_SECONDS
        ):
            return state
        try:
            found = self.api.call(
                "GET",
                namespaced(namespace, "events"),
                query={
                    "fieldSelector": f"involvedObject.kind=Pod,involvedObject.name={state.name}"
                    ",type=Warning"
                },
            )
        except ApiError as err:  # the pass goes on with what the pod's status says
            log.info("pod %s/%s: its Events not read: %s", namespace, state.name, message(err))
            return state
        events = found.get("items") or []
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if killed:
            said = liveness_kill(events, uid)
            return dataclasses.replace(state, disruption=said) if said else state
        reason, words = kubelet_said(events, uid)
        if not reason:
            return state
        return dataclasses.replace(state, waiting_reason=reason, waiting_message=words)

    def pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """The job's pods as watched, with what this operator did since (a pod it created
        and the watch has not shown yet; one it deleted, as deleting); listed before the
        watch's index is there."""
        if self.pod_index is None:
            return self.list_pods(namespace, f"{builders.LABEL_JOB}={job}")
        pods = {p["metadata"]["name"]: p for p in self.pod_index(namespace, job)}
        with self._lock:
            made = self._made.get((namespace, job)) or {}
            for name, pod in list(made.items()):
                if name not in pods or _newer(pod, pods[name]):
                    pods[name] = pod
                else:  # the watch spoke of it before the create answered: the index knows
                    del made[name]
            if not made:
                self._made.pop((namespace, job), None)
            for name, pod in pods.items():
                uid, stamp = self._deleted.get((namespace, name)) or ("", "")
                meta = pod["metadata"]
                if uid and meta.get("uid") == uid and not meta.get("deletionTimestamp"):
                    pods[name] = {**pod, "metadata": {**meta, "deletionTimestamp": stamp}}
        return list(pods.values())

    def pod_event(self, type_: str | None, pod: Mapping[str, Any]) -> None:
        """The watch spoke of a job's pod (after kopf's index took it in): what this operator
        remembered of it is forgotten, the index knows better now."""
        meta = pod.get("metadata") or {}
        job = (meta.get("labels") or {}).get(builders.LABEL_JOB)
        name, namespace = meta.get("name"), meta.get("namespace", "")
        if not job or not name:
            return
        key = (namespace, job)
        with self._lock:
            made = self._made.get(key)
            if made is not None:
                made.pop(name, None)
                if not made:
                    del self._made[key]
            if type_ == "DELETED":
                self._deleted.pop((namespace, name), None)
                if len(self._gone) >= GONE_MAX:
                    self._gone.clear()
                version = _version(pod)
                if version is not None:
                    self._gone[namespace, name] = version

    def _created(self, namespace: str, pod: Mapping[str, Any]) -> None:
        """A pod this operator created, as the API server answered: read by the next pass
        until the watch speaks of it (unless the watch already saw it deleted)."""
        meta = pod.get("metadata") or {}
        job = (meta.get("labels") or {}).get(builders.LABEL_JOB)
        name = meta.get("name")
        if not job or not name:
            return
        version = _version(pod)
        with self._lock:
            gone = self._gone.get((namespace, name))
            if gone is not None and version is not None and version <= gone:
                return
            self._made.setdefault((namespace, job), {})[name] = slim_pod(pod)

    def _deleting(self, namespace: str, name: str, uid: str) -> None:
        """A pod this operator deleted (that one, by uid: a successor of its name is not):
        read as deleting until its watch says it is gone."""
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self._lock:
            if len(self._deleted) >= GONE_MAX:
                self._deleted.clear()
            self._deleted[namespace, name] = (uid, stamp)

    def _kept(self, job: Mapping[str, Any]) -> list[str] | None:
        """The keys of the job's Secret, when it, the NetworkPolicy and the Service were all
        read as there (what the operator creates once, never changes, and reads on every pass);
        None otherwise. Once KEPT_FOR seconds old, they are read again in the background while
        this pass goes on with what was read (three reads in a pass were a phase-to-status
        slower every 30 s): one found gone is forgotten, and `on_gone` asks for a pass."""
        meta = job["metadata"]
        key = (meta["namespace"], meta["name"], meta.get("uid", ""))
        now = time.monotonic()
        with self._lock:
            kept = self._known.get(key)
            due = kept is not None and kept[0] < now
            if kept is not None and due:  # one read again at a time: the next in KEPT_FOR
                self._known[key] = (now + KEPT_FOR, kept[1])
        if kept is None:
            return None
        if due:
            self.reads.submit(self._recheck, {"metadata": dict(meta)})  # all its reads need
        return kept[1]

    def _recheck(self, job: Mapping[str, Any]) -> None:
        meta = job["metadata"]
        try:
            changed: list[str] = []
            keys, network_policy, service = self._read_children(job, at_once=False, changed=changed)
            there = keys is not None and network_policy and service and not changed
        except Exception as err:  # the pass reads them itself, and says what went wrong
            log.info(
                "TrainingJob %s/%s: its children read again: %s",
                meta["namespace"],
                meta["name"],
                err,
            )
            keys, there = None, False
        if there and keys is not None:
            self._keep(meta, keys)
            return
        with self._lock:
            self._known.pop((meta["namespace"], meta["name"], meta.get("uid", "")), None)
        self.on_gone(meta["namespace"], meta["name"])

    def child_deleted(self, namespace: str, job: str) -> None:
        """The watch saw a child of the job deleted (its Service): read them all on its next
        pass, which makes it again, rather than trust what was read before."""
        with self._lock:
            for key in [k for k in self._known if k[:2] == (namespace, job)]:
                del self._known[key]

    def _read_children(
        self,
        job: Mapping[str, Any],
        *,
        at_once: bool = True,
        taken: list[str] | None = None,
        changed: list[str] | None = None,
    ) -> tuple[list[str] | None, bool, bool]:
        """The keys of the job's Secret (None without one), and whether its NetworkPolicy (or
        none is wanted) and its Service exist: three reads, two of them on `reads` beside the
        third when `at_once` (not from a task of `reads` itself, which could wait on its own).
        One that is someone else's reads as missing, and what it is goes to `taken`; a Secret
        whose data is not what it was made with says how in `changed`."""
        meta = job["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        taken = [] if taken is None else taken

        def policy() -> bool:
            path = namespaced(namespace, "networkpolicies", name, group="networking.k8s.io/v1")
            return not self.network_policies or self._ours(job, path, taken) is not None

        def service() -> bool:
            return self._ours(job, namespaced(namespace, "services", name), taken) is not None

        def secret() -> list[str] | None:
            path = namespaced(namespace, "secrets", builders.secret_name(job))
            found = self._ours(job, path, taken)
            if found is None:
                return None
            data = found.get("data") or {}
            if changed is not None and (why := secret_changed(found)):
                changed.append(why)
            return sorted(data.keys())

        if not at_once:
            return secret(), policy(), service()
        keys = self.reads.submit(secret)
        network_policy = self.reads.submit(policy)
        return keys.result(), network_policy.result(), service()

    def _keep(self, meta: Mapping[str, Any], keys: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._known) > KEPT_MAX:  # jobs long gone: drop what has expired
                self._known = {k: v for k, v in self._known.items() if v[0] >= now}
            self._known[(meta["namespace"], meta["name"], meta.get("uid", ""))] = (
                now + KEPT_FOR,
                keys,
            )

    def credentials(self, job: Mapping[str, Any], network: builders.Network) -> dict[str, bytes]:
        return issuer.issue(job, network)

    def _ours(self, job: Mapping[str, Any], path: str, taken: list[str]) -> dict[str, Any] | None:
        """The job's child at `path`, or None when there is none, or one that is not the job's:
        someone else's object with the name, said in `taken` (the job fails NameTaken)."""
        try:
            found: dict[str, Any] = self.api.call("GET", path) or {}
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        why = foreign(found, job)
        if why is None:
            return found
        kind = {"services": "Service", "secrets": "Secret"}.get(path.split("/")[-2])
        taken.append(f"{kind or 'NetworkPolicy'} {path.rsplit('/', 1)[1]} {why}")
        return None

    def network(self, job: Mapping[str, Any]) -> builders.Network:
        return builders.dns_network(job)

    def write_status(self, job: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        self.replace_job_status({**job, "status": dict(status)})

    def task_progress(self, pod: PodState) -> dict[str, float]:
        return progress.of_task(pod)

    # --- TrainingJobs -------------------------------------------------------------------------

    def seen(self, type_: str | None, job: Mapping[str, Any]) -> None:
        """A watch event of a TrainingJob: its body is what the next pass reads, unless the
        body kept is newer (a status this operator wrote, whose own event is still to come)."""
        meta = job.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        with self._lock:
            if type_ == "DELETED":
                self._jobs.pop(key, None)
            elif _newer(job, self._jobs.get(key)):
                self._jobs[key] = dict(job)

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The job as last seen (watched, or as its status was written), else read."""
        with self._lock:
            job: dict[str, Any] | None = self._jobs.get((namespace, name))
        if job is not None:
            return job
        try:
            found: dict[str, Any] = self.api.call(
                "GET", namespaced(namespace, PLURAL, name, group=API)
            )
        except ApiError as err:
            if err.status != 404:
                raise
            return None
        return found

    def replace_job_status(self, job: Mapping[str, Any]) -> None:
        """Writes `job`'s status, guarded by its resourceVersion (409 -> `ConflictError`) and
        uid. The body is the status and the metadata that name the job: a write to the status
        subresource takes nothing else from it (the API server copies the rest from the job
        it has), and decoding the spec and the field bookkeeping of every job sent, to throw
        them away, was 0.6 ms of the API server's CPU per write."""
        meta = job["metadata"]
        key = (meta["namespace"], meta["name"])
        path = namespaced(meta["namespace"], PLURAL, meta["name"], group=API)
        body = {
            "apiVersion": job.get("apiVersion", API),
            "kind": job.get("kind", KIND),
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "resourceVersion", "uid") if k in meta
            },
            "status": job.get("status") or {},
        }
        try:
            written = self.api.call("PUT", f"{path}/status", body=body)
        except ApiError as err:
            with self._lock:  # the pass is repeated: on the job as the API server has it
                self._jobs.pop(key, None)
            if err.status == 409:
                raise ConflictError(
                    f"TrainingJob {meta['name']} changed while it was reconciled"
                ) from err
            if err.status == 404:
                return
            raise
        if isinstance(written, dict):
            self.seen("MODIFIED", written)

    def delete_job(self, job: Mapping[str, Any]) -> None:
        """Deletes the job; the garbage collector deletes its children (owner references)."""
        meta = job["metadata"]
        with self._lock:  # what follows reads it from the API server: deleting, or gone
            self._jobs.pop((meta["namespace"], meta["name"]), None)
        try:
            self.api.call(
                "DELETE",
                namespaced(meta["namespace"], PLURAL, meta["name"], group=API),
                body={
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "propagationPolicy": "Background",
                },
            )
        except ApiError as err:
            if err.status != 404:
                raise

    # --- children -----------------------------------------------------------------------------

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        found = self.api.call(
            "GET", namespaced(namespace, "pods"), query={"labelSelector": selector}
        )
        items: list[dict[str, Any]] = found.get("items") or []
        return items

    def create(self, job: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
        """Creates a Pod, the Service, Secret or NetworkPolicy in the job's namespace; False
        when it already exists."""
        namespace = job["metadata"]["namespace"]
        path = {
            "Pod": namespaced(namespace, "pods"),
            "Service": namespaced(namespace, "services"),
            "Secret": namespaced(namespace, "secrets"),
            "NetworkPolicy": namespaced(namespace, "networkpolicies", group="networking.k8s.io/v1"),
        }[manifest["kind"]]
        try:
            made = self.api.call("POST", path, body=dict(manifest))
        except ApiError as err:
            if err.status == 409:  # ours from an earlier pass, or someone else's: never taken
                self._owned(job, f"{path}/{manifest['metadata']['name']}", manifest["kind"])
                return False
            if err.status in (400, 422):  # invalid: the manifest, which no retry changes
                raise RefusedError(
                    f"{manifest['kind']} {manifest['metadata']['name']}: {message(err)}"
                ) from err
            raise
        if manifest["kind"] == "Pod" and isinstance(made, dict):
            self._created(namespace, made)  # the next pass sees it before its watch event
        return True

    def _owned(self, job: Mapping[str, Any], path: str, kind: str) -> None:
        """Raises `NameTakenError` unless the object at `path` is the job's (or gone)."""
        try:
            found = self.api.call("GET", path)
        except ApiError as err:
            if err.status == 404:
                return
            raise
        why = foreign(found or {}, job)
        if why is not None:
            name = path.rsplit("/", 1)[1]
            raise NameTakenError(f"{kind} {name} {why}")

    def delete_pod(self, job: Mapping[str, Any], name: str, *, force: bool = False) -> bool:
        """Deletes a pod (`force`: at once, grace period 0, for a pod on a lost node, whose
        kubelet cannot confirm it ended); False when it was already gone."""
        namespace = job["metadata"]["namespace"]
        try:
            deleted = self.api.call(
                "DELETE",
                namespaced(namespace, "pods", name),
                query={"gracePeriodSeconds": "0"} if force else None,
            )
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        uid = ((deleted or {}).get("metadata") or {}).get("uid")
        if uid:
            self._deleting(namespace, name, str(uid))
        return True

    # --- events -------------------------------------------------------------------------------

    def post_event(self, job: Mapping[str, Any], event: Event) -> None:
        """A core/v1 Event on the TrainingJob (what `kubectl describe tj` shows)."""
        meta = job["metadata"]
        type_, reason, message = event.type, event.reason, event.message
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:12]}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": API,
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid", ""),
                "resourceVersion": meta.get("resourceVersion", ""),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": os.environ.get("HOSTNAME", COMPONENT),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.api.call("POST", namespaced(meta["namespace"], "events"), body=body)
