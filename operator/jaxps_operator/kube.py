"""The Kubernetes adapter of the `Cluster` port: the API server, through the official client.

Every call here blocks on the network, so the controller only makes them from worker threads,
never on kopf's event loop. Creating an object that already exists (409) and deleting one that
is gone (404) count as success: children have deterministic names and a pass may be repeated.
A task's progress is read from its pod IP and its container port named `metrics`; its final
summary is its container's termination message.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from jaxps_operator import builders, capacity, issuer, progress
from jaxps_operator.conditions import Event, parse_time
from jaxps_operator.objects import PodState
from jaxps_operator.reconcile import Children, ConflictError

__all__ = [
    "ApiException",
    "ConflictError",
    "KubeCluster",
    "load_config",
    "message",
    "pod_state",
    "waiting",
]

GROUP, VERSION, PLURAL, KIND = "jaxps.dev", "v1alpha1", "trainingjobs", "TrainingJob"
COMPONENT = "jaxps-operator"


# Connections kept open to the API server, per client: at least as many as threads may call it
# at once (4 passes, their creates and reads). The client's default (5 per core) is fewer, and
# urllib3 closes what does not fit: most calls then paid a new TLS handshake, which took half
# of the operator's CPU and more of the API server's while 100 jobs were created.
CONNECTIONS = 32
# A job's Secret, NetworkPolicy and Service, once read as there, are not read again for this
# long (a pass per pod event read them all each time): one deleted by hand is made again
# within KEPT_FOR seconds and the job's next pass.
KEPT_FOR = 30.0
KEPT_MAX = 10_000


def load_config() -> None:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = CONNECTIONS
    client.Configuration.set_default(configuration)


def message(err: ApiException) -> str:
    """The apiserver's own words for a refused request."""
    try:
        return str(json.loads(err.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(err.reason)


def _json(response: Any) -> Any:
    return json.loads(response.data)  # read to its end, so the connection goes back to the pool


def _newer(job: Mapping[str, Any], than: Mapping[str, Any] | None) -> bool:
    """Whether `job` is a later version of the same object than `than` (etcd's resource
    versions grow; one that is no number is taken as later)."""
    if than is None:
        return True
    if (job.get("metadata") or {}).get("uid") != than["metadata"].get("uid"):
        return True
    try:
        return int(job["metadata"]["resourceVersion"]) > int(than["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return True


def released(response: Any) -> None:
    """Reads an answer (`_preload_content=False`) whose body is not wanted to its end, and
    gives its connection back to the pool: one left unread is never reused, and the next
    call pays a new TLS handshake."""
    response.drain_conn()
    response.release_conn()


# A container waits for these on its normal way to running; any other waiting reason
# (ErrImagePull, ImagePullBackOff, CreateContainerConfigError, ...) is a problem to report.
STARTING = ("ContainerCreating", "PodInitializing")


def waiting(pod: Mapping[str, Any], main: Mapping[str, Any]) -> tuple[str, str]:
    """Why a Pending pod waits, as (reason, message): the scheduler's PodScheduled=False
    (Unschedulable: `0/1 nodes are available: 1 Insufficient cpu`), else its main container's
    waiting reason unless it is on its normal way; ("", "") when it waits for nothing wrong."""
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return str(c.get("reason") or "Unschedulable"), str(c.get("message") or "")
    for container in status.get("containerStatuses") or []:
        if container.get("name") != main.get("name"):
            continue
        state = (container.get("state") or {}).get("waiting") or {}
        reason = str(state.get("reason") or "")
        if reason and reason not in STARTING:
            return reason, str(state.get("message") or "")
    return "", ""


def pod_state(pod: Mapping[str, Any], owner_uid: str) -> PodState | None:
    """What the planner needs of a pod; pods of another job with the same name count as leaving."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    try:
        role, index = labels[builders.LABEL_ROLE], int(labels[builders.LABEL_INDEX])
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    owned = any(ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or [])
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    main = containers[0]
    terminated: Mapping[str, Any] = {}
    for container in status.get("containerStatuses") or []:
        state = (container.get("state") or {}).get("terminated")
        if state and (container.get("name") == main.get("name") or not terminated):
            terminated = state
    phase = status.get("phase", "Pending")
    ip = status.get("podIP")
    why, words = waiting(pod, main) if phase == "Pending" else ("", "")
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
    )


class KubeCluster:
    """The `Cluster` of the API server the client is configured for. Thread-safe."""

    def __init__(
        self, api_client: client.ApiClient | None = None, *, network_policies: bool = True
    ) -> None:
        """`network_policies`: whether jobs get one (else they are never read: no RBAC)."""
        self.network_policies = network_policies
        self.client = api_client or client.ApiClient()
        self.core = client.CoreV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)
        self.networking = client.NetworkingV1Api(self.client)
        self.reads = ThreadPoolExecutor(4, thread_name_prefix="jaxps-read")
        # (namespace, name, uid) -> (until, the Secret's keys): see `_kept`
        self._known: dict[tuple[str, str, str], tuple[float, list[str]]] = {}
        self._lock = threading.Lock()
        self._pods_ahead: dict[tuple[str, str], Future[list[dict[str, Any]]]] = {}
        self._jobs: dict[tuple[str, str], dict[str, Any]] = {}  # see `seen`

    # --- the port -----------------------------------------------------------------------------

    def children(self, job: Mapping[str, Any]) -> Children:
        meta = job["metadata"]
        namespace = meta["namespace"]
        with self._lock:
            pods = self._pods_ahead.pop((namespace, meta["name"]), None)
        if pods is None:
            pods = self.reads.submit(
                self.list_pods, namespace, f"{builders.LABEL_JOB}={meta['name']}"
            )
        keys = self._kept(meta)
        if keys is None:  # read what is not known to exist: the Secret, NetworkPolicy, Service
            secret = self.reads.submit(self._secret_keys, namespace, builders.secret_name(job))
            policy = self.reads.submit(
                lambda: (
                    not self.network_policies
                    or self._exists(
                        self.networking.read_namespaced_network_policy, namespace, meta["name"]
                    )
                )
            )
            service = self.service_exists(namespace, meta["name"])
            keys = secret.result()
            if keys is not None and policy.result() and service:
                self._keep(meta, keys)
            network_policy = policy.result()
        else:
            service = network_policy = True
        states = [s for p in pods.result() if (s := pod_state(p, meta.get("uid", ""))) is not None]
        return Children(
            pods=states,
            service=service,
            secret=keys is not None,
            network_policy=network_policy,
            issued_workers=capacity.issued_workers(keys, job) if keys is not None else None,
        )

    def _kept(self, meta: Mapping[str, Any]) -> list[str] | None:
        """The keys of the job's Secret, when it, the NetworkPolicy and the Service were all
        read as there within the last KEPT_FOR seconds (what the operator creates once, never
        changes, and reads on every pass); None otherwise."""
        with self._lock:
            kept = self._known.get((meta["namespace"], meta["name"], meta.get("uid", "")))
        if kept is None or kept[0] < time.monotonic():
            return None
        return kept[1]

    def _keep(self, meta: Mapping[str, Any], keys: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._known) > KEPT_MAX:  # jobs long gone: drop what has expired
                self._known = {k: v for k, v in self._known.items() if v[0] >= now}
            self._known[(meta["namespace"], meta["name"], meta.get("uid", ""))] = (
                now + KEPT_FOR,
                keys,
            )

    def _secret_keys(self, namespace: str, name: str) -> list[str] | None:
        """The keys of the job's Secret of credentials (what was issued), or None without."""
        try:
            found = _json(self.core.read_namespaced_secret(name, namespace, _preload_content=False))
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return sorted((found.get("data") or {}).keys())

    def credentials(self, job: Mapping[str, Any], network: builders.Network) -> dict[str, bytes]:
        return issuer.issue(job, network)

    @staticmethod
    def _exists(read: Any, namespace: str, name: str) -> bool:
        try:
            released(read(name, namespace, _preload_content=False))
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

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
        """The job as last seen (watched, or as its status was written), else read; its pods
        are read beside it for the pass's `children`."""
        ahead = self.reads.submit(self.list_pods, namespace, f"{builders.LABEL_JOB}={name}")
        with self._lock:  # a key's passes never overlap: this one's `children` takes it
            self._pods_ahead[namespace, name] = ahead
            job: dict[str, Any] | None = self._jobs.get((namespace, name))
        try:
            if job is None:
                job = _json(
                    self.custom.get_namespaced_custom_object(
                        GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
                    )
                )
        except ApiException as err:
            if err.status != 404:
                raise
        finally:
            if job is None or job["metadata"].get("deletionTimestamp"):  # no pass follows
                with self._lock:
                    self._pods_ahead.pop((namespace, name), None)
        return job

    def replace_job_status(self, job: Mapping[str, Any]) -> None:
        """Writes `job`'s status, guarded by its resourceVersion (409 -> `ConflictError`)."""
        meta = job["metadata"]
        key = (meta["namespace"], meta["name"])
        try:
            written = self.custom.replace_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], dict(job)
            )
        except ApiException as err:
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
            self.custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                meta["namespace"],
                PLURAL,
                meta["name"],
                propagation_policy="Background",
            )
        except ApiException as err:
            if err.status != 404:
                raise

    # --- children -----------------------------------------------------------------------------

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = _json(
            self.core.list_namespaced_pod(
                namespace, label_selector=selector, _preload_content=False
            )
        )["items"]
        return items

    def service_exists(self, namespace: str, name: str) -> bool:
        return self._exists(self.core.read_namespaced_service, namespace, name)

    def create(self, job: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
        """Creates a Pod, the Service, Secret or NetworkPolicy in the job's namespace; False
        when it already exists."""
        namespace = job["metadata"]["namespace"]
        create: Any = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "Secret": self.core.create_namespaced_secret,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
        }[manifest["kind"]]
        body: Any = dict(manifest)  # the client takes plain dicts as well as its models
        try:
            released(create(namespace, body, _preload_content=False))
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        return True

    def delete_pod(self, job: Mapping[str, Any], name: str) -> bool:
        """Deletes a pod; False when it was already gone."""
        namespace = job["metadata"]["namespace"]
        try:
            released(self.core.delete_namespaced_pod(name, namespace, _preload_content=False))
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

    # --- events -------------------------------------------------------------------------------

    def post_event(self, job: Mapping[str, Any], event: Event) -> None:
        """A core/v1 Event on the TrainingJob (what `kubectl describe tj` shows)."""
        meta = job["metadata"]
        type_, reason, message = event.type, event.reason, event.message
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: Any = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:12]}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
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
        released(self.core.create_namespaced_event(meta["namespace"], body, _preload_content=False))
