"""`Client`: create, follow and delete TrainingJobs from Python, on Kubernetes or on this machine.

One interface, two backends (the `Backend` port): `KubernetesBackend` talks to the API server
(kubeconfig or in-cluster); `LocalBackend` runs each job as `jaxps local` does, in the
background, and reads the same status from its work directory. What both share (reading a
manifest, validating it, waiting for a condition) lives here once.

No JAX, numpy or gRPC is imported: the SDK works in any notebook that has the `jaxps` package.
Thread-safe as its backend is: both are (each call is independent).
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

from jaxps.sdk.model import (
    Event,
    InvalidManifestError,
    JaxpsError,
    Job,
    JobFailedError,
    LogLine,
    Progress,
    ScaleRefusedError,
    WaitTimeoutError,
)
from jaxps_operator import capacity, schema
from jaxps_runtime.config import yamltext

Manifest = str | Path | Mapping[str, Any]
TERMINAL = ("Succeeded", "Failed")
# the types of status.conditions (the CRD's), the conditions `wait` can wait for
CONDITIONS = (
    "Created",
    "PodsReady",
    "Running",
    "Restarting",
    "Succeeded",
    "Failed",
    "Suspended",
    "Queued",  # under Kueue: waiting for admission
    "Admitted",
    "Preempted",
    "ScalingLimited",  # a scale asked for more workers than the job was issued
)
REQUEST_SECONDS = 30.0  # the Kubernetes backend's default timeout of one API request


class Backend(Protocol):
    """Where jobs run. `create` takes a validated manifest; every other call names the job and
    raises `JobNotFoundError` when there is none. A backend with a server gives up on a
    request after its own timeout, or `get`'s `timeout` when that is shorter, and raises
    `ServerUnreachableError`."""

    where: str  # "namespace default of https://...", "/home/me/.local/share/jaxps/local"

    def create(self, manifest: Mapping[str, Any]) -> Job: ...
    def get(self, name: str, *, timeout: float | None = None) -> Job: ...
    def list(self) -> builtins.list[Job]: ...
    def delete(self, name: str, *, wait: bool) -> None: ...
    def scale(self, name: str, workers: int) -> None: ...
    def events(self, name: str) -> builtins.list[Event]: ...
    def logs(self, name: str, *, task: str | None, follow: bool) -> Iterator[LogLine]: ...


class Client:
    """TrainingJobs on one backend.

    from jaxps.sdk import Client
    client = Client.local()                   # or Client.kubernetes(namespace="team-a")
    job = client.create("examples/mnist.yaml")
    job = client.wait(job.name, timeout=600)  # Succeeded, else JobFailedError
    print(job.progress)
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @classmethod
    def local(cls, root: str | Path | None = None) -> Client:
        """Jobs as processes on this machine, each in `root/<name>` (default
        `$XDG_DATA_HOME/jaxps/local`, else `~/.local/share/jaxps/local`)."""
        from jaxps.sdk.local import LocalBackend  # noqa: PLC0415

        return cls(LocalBackend(root=Path(root) if root is not None else None))

    @classmethod
    def kubernetes(
        cls,
        *,
        namespace: str | None = None,
        kubeconfig: str | Path | None = None,
        context: str | None = None,
        timeout: float = REQUEST_SECONDS,
    ) -> Client:
        """Jobs on a cluster: `kubeconfig` (default $KUBECONFIG or ~/.kube/config), or the
        pod's service account in a cluster; `namespace` default: the context's, else
        `default`. `timeout`: seconds each API request may take to connect, and then to
        answer; a server that does not raises `ServerUnreachableError` naming it."""
        from jaxps.sdk.kubernetes import KubernetesBackend  # noqa: PLC0415

        return cls(
            KubernetesBackend(
                namespace=namespace,
                kubeconfig=str(kubeconfig) if kubeconfig is not None else None,
                context=context,
                timeout=timeout,
            )
        )

    def create(self, manifest: Manifest) -> Job:
        """Submits a TrainingJob: a manifest file, YAML or JSON text, or a dict. Invalid
        manifests raise `InvalidManifestError` naming every field, and nothing is created."""
        return self.backend.create(load(manifest))

    def get(self, name: str) -> Job:
        return self.backend.get(name)

    def list(self) -> builtins.list[Job]:
        return self.backend.list()

    def progress(self, name: str) -> Progress:
        return self.backend.get(name).progress

    def events(self, name: str) -> builtins.list[Event]:
        """The job's Events, oldest first."""
        return self.backend.events(name)

    def logs(
        self, name: str, task: str | None = None, *, follow: bool = False
    ) -> Iterator[LogLine]:
        """Lines of one task's log (`task`: `worker-1` or the pod name), or of every task;
        `follow=True` goes on as they are written, until the tasks are done."""
        return self.backend.logs(name, task=task, follow=follow)

    def scale(self, name: str, workers: int) -> Job:
        """Sets the job's worker replicas, as `kubectl scale tj/NAME --replicas=N` does: new
        workers join the training, removed ones (the highest indexes first, never worker 0)
        finish their batch, give their data back and leave. Only workers scale. Raises
        `ScaleRefusedError` naming the field, the value and what is allowed (below
        minReplicas, above maxReplicas or the workers issued at creation, a finished job);
        returns the job as it is once the change is stored."""
        job = self.backend.get(name)
        why: str | None
        if isinstance(workers, bool) or not isinstance(workers, int):
            why = f"{capacity.REPLICAS} {workers!r} is not an integer"
        elif job.finished:
            why = f"the job is {job.state}: nothing runs to scale"
        else:
            issued = job.workers.max or None  # known once the operator wrote status.workers
            why = capacity.refusal(job.raw, workers, issued_workers=issued)
        if why is not None:
            raise ScaleRefusedError(name, workers, why)
        self.backend.scale(name, workers)
        return self.backend.get(name)

    def delete(self, name: str, *, wait: bool = True) -> None:
        """Deletes the job and everything it owns (its pods or processes stop); with `wait`,
        returns once they are gone."""
        self.backend.delete(name, wait=wait)

    def wait(
        self,
        name: str,
        condition: str = "Succeeded",
        *,
        timeout: float = 600.0,
        interval: float = 1.0,
    ) -> Job:
        """Waits until the job's `condition` (one of `CONDITIONS`) is True, as `kubectl wait
        --for=condition=...` does; returns the job. Raises `JobFailedError` when the job
        finished without it (it never will be), and `WaitTimeoutError` after `timeout`
        seconds; no request outlives that deadline. An unknown condition is a ValueError at
        once, not a wait that never ends."""
        if condition not in CONDITIONS:
            raise ValueError(
                f"wait: condition {condition!r} is not one a TrainingJob has; expected one of "
                f"{', '.join(CONDITIONS)}"
            )
        if timeout < 0 or interval <= 0:
            raise ValueError(f"wait: timeout {timeout}, interval {interval}; expected >= 0, > 0")
        deadline = time.monotonic() + timeout
        while True:
            job = self.backend.get(name, timeout=max(deadline - time.monotonic(), 0.1))
            found = job.condition(condition)
            if found is not None and found.status:
                return job
            if job.state in TERMINAL and condition != job.state:
                raise JobFailedError(job, condition)
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(job, condition, timeout)
            time.sleep(min(interval, left))


def load(manifest: Manifest) -> dict[str, Any]:
    """A TrainingJob from a file, text or dict, validated as `jaxps validate` does (the CRD's
    schema, then `spec.training`); the manifest as given, not with defaults applied."""
    if isinstance(manifest, Mapping):
        source, text = "manifest", yaml.safe_dump(dict(manifest))
    elif isinstance(manifest, Path) or _names_a_file(manifest):
        source = str(manifest)
        try:
            text = Path(manifest).read_text()
        except OSError as err:
            raise JaxpsError(f"{manifest}: cannot read it: {err.strerror}") from None
    else:
        source, text = "manifest", manifest
    try:
        schema.load(text)
    except schema.InvalidManifestError as err:
        raise InvalidManifestError(source, [str(p) for p in err.problems]) from None
    loaded: dict[str, Any] = yamltext.load(text)
    return loaded


def _names_a_file(text: str) -> bool:
    """A one-line string that is a file, or looks like a manifest's file name."""
    return "\n" not in text and (text.endswith((".yaml", ".yml", ".json")) or Path(text).is_file())
