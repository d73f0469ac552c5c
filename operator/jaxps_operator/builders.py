"""The children of a TrainingJob, built from the job and what the cluster gives it.

    service(job)                                        -> the headless Service
    secret(job, files)                                  -> the Secret of the job's credentials
    network_policy(job)                                 -> only the job's pods reach its pods
    pod(job, role, index, network=..., image=...)       -> the pod of one task

Pure functions: everything a pod needs comes in as input (the job with its defaults, the
addresses of every task and each task's metrics port from `Network`, the image to use when the
template names none), and the backends create what they get, unchanged. Kubernetes' network is
`<job>-<role>-<i>.<job>.<ns>.svc:2222` with the metrics port of the template (`dns_network`); the
local backend gives 127.0.0.1 and free ports.

Every task gets its credentials for mutual TLS (JAXPS_TLS_DIR): on Kubernetes the job's Secret
mounted read-only, with only the task's own certificate and key and the job's CA in it; locally
a directory of the work directory (`Network.tls_dirs`).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxps_runtime.config import cluster

ROLES = ("chief", "ps", "worker", "evaluator")
MAIN_CONTAINER = "jaxps"
"""The name of the container jaxps runs in; a template's only container may have another."""
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
# What jaxps sets in every task's main container; a template's own value of these is replaced.
# Every other variable of the template, JAXPS_LOG_LEVEL and JAXPS_BIND_ADDRESS included, is kept.
STANDBY_ENV = "JAXPS_PS_STANDBY"  # jaxps_runtime.process.keeper.KEEPER_ENV
RESERVED_ENV = (
    "TF_CONFIG",
    "JAXPS_TRAINING",
    "JAXPS_JOB_NAME",
    "JAXPS_JOB_UID",
    "JAXPS_METRICS_PORT",
    "JAXPS_TLS_DIR",
    "JAXPS_POD_IP",
    "JAXPS_TERMINATION_LOG",
)
# Where a container's termination message is read unless its template says otherwise
TERMINATION_LOG = "/dev/termination-log"
TLS_DIR = "/var/run/jaxps/tls"  # where a pod's credentials are mounted
TLS_VOLUME = "jaxps-tls"
RUNTIME_GID = 65532  # docker/runtime.Dockerfile's USER
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
# The runtime's health on its plaintext metrics port (process.metrics): the kubelet has no
# certificate for the gRPC port, which takes only the job's own tasks (mutual TLS)
LIVE_PATH = "/healthz"
READY_PATH = "/readyz"
OPERATOR_LABELS = {"app.kubernetes.io/name": "jaxps"}  # the chart's operator pods


@dataclass(frozen=True)
class Network:
    """Where the tasks of one job are: every task's gRPC address by role, and the metrics port
    of the tasks that do not use the template's (by pod name)."""

    addresses: Mapping[str, list[str]]
    metrics_ports: Mapping[str, int] = field(default_factory=dict)
    tls_dirs: Mapping[str, str] = field(default_factory=dict)  # pod -> its credentials (local)


def replicas(job: Mapping[str, Any]) -> dict[str, int]:
    specs = job["spec"]["replicaSpecs"]
    return {
        role: int(specs[role]["replicas"])
        for role in ROLES
        if role in specs and int(specs[role]["replicas"]) > 0
    }


def tasks(job: Mapping[str, Any]) -> list[tuple[str, int]]:
    """Every (role, index) of the job, chief first."""
    return [(role, index) for role, count in replicas(job).items() for index in range(count)]


def pod_name(job: Mapping[str, Any], role: str, index: int) -> str:
    return cluster.pod_name(job=job["metadata"]["name"], role=role, index=index)


def chief_task(job: Mapping[str, Any]) -> tuple[str, int]:
    return ("chief", 0) if "chief" in replicas(job) else ("worker", 0)


def dns_network(job: Mapping[str, Any]) -> Network:
    """Kubernetes: the Service's DNS names on port 2222; metrics on the template's port."""
    name = job["metadata"]["name"]
    namespace = job["metadata"].get("namespace", "default")
    return Network(
        addresses={
            role: [
                cluster.dns_address(job=name, role=role, index=i, namespace=namespace, port=PORT)
                for i in range(n)
            ]
            for role, n in replicas(job).items()
        }
    )


def training_json(job: Mapping[str, Any]) -> str:
    return json.dumps(job["spec"]["training"], sort_keys=True)


def labels(
    job: Mapping[str, Any], role: str | None = None, index: int | None = None
) -> dict[str, str]:
    out = {LABEL_JOB: job["metadata"]["name"]}
    if role is not None:
        out[LABEL_ROLE] = role
    if index is not None:
        out[LABEL_INDEX] = str(index)
    return out


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": job.get("apiVersion", "jaxps.dev/v1alpha1"),
        "kind": "TrainingJob",
        "name": job["metadata"]["name"],
        "uid": job["metadata"].get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned(job: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The metadata of a child named `name`: the job's label and its owner reference, so it
    goes with the job."""
    return {"name": name, "labels": labels(job), "ownerReferences": [owner_reference(job)]}


def service(job: Mapping[str, Any]) -> dict[str, Any]:
    """The headless Service that gives every pod `<pod>.<job>.<ns>.svc`."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned(job, job["metadata"]["name"]),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(job),
            "ports": [{"name": "grpc", "port": PORT, "targetPort": PORT}],
        },
    }


def secret_name(job: Mapping[str, Any]) -> str:
    """One per job incarnation: a job deleted and created again never mounts the old one."""
    uid = str(job["metadata"].get("uid") or "")
    return f"{job['metadata']['name']}-tls-{uid[:8]}" if uid else f"{job['metadata']['name']}-tls"


def cert_key(pod: str) -> str:
    return f"{pod}.crt"


def key_key(pod: str) -> str:
    return f"{pod}.key"


DIGEST_ANNOTATION = "jaxps.dev/credentials-sha256"
"""On the job's Secret: the digest of the data it was made with (`secret_digest`), so that a
Secret changed while the job runs is noticed (its tasks hold the keys it had)."""


def secret(job: Mapping[str, Any], files: Mapping[str, bytes]) -> dict[str, Any]:
    """The job's credentials: its CA (`ca.crt`) and each task's `<pod>.crt` and `<pod>.key`,
    with the digest of them all (`DIGEST_ANNOTATION`)."""
    data = {k: base64.b64encode(v).decode() for k, v in sorted(files.items())}
    metadata = owned(job, secret_name(job))
    metadata["annotations"] = {DIGEST_ANNOTATION: secret_digest(data)}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata,
        "data": data,
    }


def secret_digest(data: Mapping[str, str]) -> str:
    """The sha256 of a Secret's data (base64 values, as the API serves them), in key order."""
    digest = hashlib.sha256()
    for key in sorted(data):
        digest.update(f"{len(key)}:{key}={len(data[key])}:{data[key]};".encode())
    return digest.hexdigest()


def network_policy(job: Mapping[str, Any]) -> dict[str, Any]:
    """Ingress to the job's pods from its own pods only, and from the operator to the metrics
    port (status.progress). A CNI that enforces NetworkPolicies makes it so."""
    own = {"matchLabels": labels(job)}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": owned(job, job["metadata"]["name"]),
        "spec": {
            "podSelector": own,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": own}]},
                {
                    "from": [
                        {
                            "namespaceSelector": {},
                            "podSelector": {"matchLabels": dict(OPERATOR_LABELS)},
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": "metrics"}],
                },
            ],
        },
    }


def probes() -> dict[str, dict[str, Any]]:
    """The kubelet's probes of a task, over plain HTTP on its `metrics` port.

    Ready (`/readyz`) once the task serves its role, which is what PodsReady counts; alive
    (`/healthz`) while the process answers at all. A hung task (60 s without an answer) is
    killed and, its pod failed, replaced by the restart policy. The startup probe gives the
    process 5 minutes to import JAX before the liveness probe starts counting; the runtime
    answers `/healthz` before it builds the model and the dataset, however long they take.
    """

    def get(path: str, *, period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": "metrics"},
            "periodSeconds": period,
            "timeoutSeconds": 5,
            "failureThreshold": failures,
        }

    return {
        "startupProbe": get(LIVE_PATH, period=2, failures=150),
        "livenessProbe": get(LIVE_PATH, period=10, failures=6),
        "readinessProbe": get(READY_PATH, period=2, failures=2),
    }


def template_metrics_port(container: Mapping[str, Any]) -> int:
    """The container's port named `metrics` (a template may choose it), else 9090."""
    for port in container.get("ports") or []:
        if port.get("name") == "metrics" and port.get("containerPort"):
            return int(port["containerPort"])
    return METRICS_PORT


def main_index(containers: Sequence[Any]) -> int | None:
    """Which of a pod's (or template's) containers jaxps runs in: the one named `jaxps` wherever
    it is listed, else the only one; None when there are several and none is named `jaxps`
    (`schema.container_problems` refuses that template). The others, the user's sidecars, keep
    their own image, command and environment."""
    for i, container in enumerate(containers):
        if isinstance(container, Mapping) and container.get("name") == MAIN_CONTAINER:
            return i
    return 0 if len(containers) <= 1 else None


def main_container(pod_spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """The container jaxps runs in (`main_index`) of a pod's spec; {} when there is none."""
    containers = pod_spec.get("containers") or []
    i = main_index(containers)
    return containers[i] if i is not None and containers else {}


def pod(
    job: Mapping[str, Any],
    role: str,
    index: int,
    *,
    network: Network,
    image: str = DEFAULT_IMAGE,
) -> dict[str, Any]:
    """The pod of one task: its template, plus what jaxps needs; `image` unless it names one."""
    spec = job["spec"]
    template = copy.deepcopy(spec["replicaSpecs"][role].get("template") or {})
    pod_spec = template.setdefault("spec", {})
    containers = pod_spec.setdefault("containers", [])
    if not containers:
        containers.append({"name": MAIN_CONTAINER})
    main = containers[main_index(containers) or 0]  # a template without one is refused first
    main.setdefault("name", MAIN_CONTAINER)
    main.setdefault("image", image)
    main.setdefault("command", ["python", "-m", "jaxps_runtime"])
    raised = ((job.get("status") or {}).get("memory") or {}).get(role)
    if raised:  # runPolicy.oomPolicy raised the role's memory (policy.memory)
        resources = main.setdefault("resources", {})
        resources.setdefault("limits", {})["memory"] = raised
        if "memory" in (resources.get("requests") or {}):
            resources["requests"]["memory"] = raised
    name = pod_name(job, role, index)
    metrics = network.metrics_ports.get(name) or template_metrics_port(main)
    env = [e for e in main.get("env", []) if e.get("name") not in RESERVED_ENV]
    env += [
        {
            "name": "TF_CONFIG",
            "value": cluster.build_tf_config(
                cluster={r: list(a) for r, a in network.addresses.items()},
                task_type=role,
                task_index=index,
            ),
        },
        {"name": "JAXPS_TRAINING", "value": training_json(job)},
        {"name": "JAXPS_JOB_NAME", "value": job["metadata"]["name"]},
        {"name": "JAXPS_JOB_UID", "value": job["metadata"].get("uid") or job["metadata"]["name"]},
        {"name": "JAXPS_METRICS_PORT", "value": str(metrics)},
        {"name": "JAXPS_TLS_DIR", "value": network.tls_dirs.get(name, TLS_DIR)},
        # the file the kubelet reads the task's last words from (the chief's outcome): the
        # template's terminationMessagePath when it sets one
        {
            "name": "JAXPS_TERMINATION_LOG",
            "value": str(main.get("terminationMessagePath") or TERMINATION_LOG),
        },
        # where the metrics and health port listens (the kubelet and the operator dial it)
        {"name": "JAXPS_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if role == cluster.PS and not any(e.get("name") == STANDBY_ENV for e in env):
        # a standby ps in the pod takes over at once when the ps is killed (process.keeper)
        env.append({"name": STANDBY_ENV, "value": "on"})
    main["env"] = env
    if name not in network.tls_dirs:  # the Secret, with this task's files only
        pod_spec.setdefault("volumes", []).append(
            {
                "name": TLS_VOLUME,
                "secret": {
                    "secretName": secret_name(job),
                    # root-owned, group fsGroup: every process of the pod may read, no other
                    "defaultMode": 0o440,
                    "items": [
                        {"key": CA_FILE, "path": CA_FILE},
                        {"key": cert_key(name), "path": CERT_FILE},
                        {"key": key_key(name), "path": KEY_FILE},
                    ],
                },
            }
        )
        main.setdefault("volumeMounts", []).append(
            {"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}
        )
        # the runtime image's group, unless the template chose one: Kubernetes adds it to
        # every process of the pod and gives it the Secret's files
        pod_spec.setdefault("securityContext", {}).setdefault("fsGroup", RUNTIME_GID)
    grpc_port = int(network.addresses[role][index].rsplit(":", 1)[1])
    ports = [
        p
        for p in main.get("ports", [])
        if p.get("name") not in ("grpc", "metrics")
        and p.get("containerPort") not in (grpc_port, metrics)
    ]
    main["ports"] = [
        *ports,
        {"name": "grpc", "containerPort": grpc_port},
        {"name": "metrics", "containerPort": metrics},
    ]
    for probe, value in probes().items():
        main.setdefault(probe, value)  # the template's own probes win
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
    metadata["labels"] = {**metadata.get("labels", {}), **labels(job, role, index)}
    metadata["ownerReferences"] = [owner_reference(job)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
