"""The SDK's Kubernetes backend: TrainingJobs through the API server, with the official client.

Credentials: a kubeconfig (given, $KUBECONFIG or ~/.kube/config) or, with none, the pod's
service account. Each backend has its own `ApiClient`, so two backends (two clusters) can live
in one notebook. Task metrics (`top`) are read through the API server's pod proxy, so they work
from outside the cluster network.

Every request has a timeout (`timeout` seconds to connect, and as many for the answer; a
followed log waits for its lines as long as they take) and is tried once: a server that is
down, refuses or hangs raises `ServerUnreachableError` naming its address and the cause, never
urllib3's own exceptions, and never waits for ever.
"""

from __future__ import annotations

import builtins
import json
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from jaxps.sdk.model import (
    Event,
    JaxpsError,
    Job,
    JobExistsError,
    JobNotFoundError,
    LogLine,
    ScaleRefusedError,
    ServerUnreachableError,
    task_pods,
)
from jaxps_operator import builders, kubeclient
from jaxps_operator.kube import GROUP, PLURAL, VERSION

GONE_SECONDS = 120.0  # delete(wait=True): for the job's pods to go


class KubernetesBackend:
    def __init__(
        self,
        *,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout {timeout}: expected seconds > 0")
        self.timeout = timeout
        try:  # the operator's loading: the client's loaders, kubeconfig first, then the pod's
            loaded = kubeclient.load(kubeconfig=kubeconfig, context=context)
        except kubeclient.LoadError as err:
            raise JaxpsError(f"{err}; give Client.kubernetes(kubeconfig=...)") from None
        configuration = loaded.configuration
        chosen = namespace or loaded.namespace
        self.namespace = chosen or "default"
        # one try per request: urllib3's retries would multiply the timeout (a GET that gets
        # no answer is sent again, three more times)
        configuration.retries = 0
        self.server = str(configuration.host)
        self.api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.where = f"namespace {self.namespace} of {configuration.host}"

    # --- the port ---------------------------------------------------------------------------

    def create(self, manifest: Mapping[str, Any]) -> Job:
        body = dict(manifest)
        meta = body.setdefault("metadata", {})
        namespace = meta.setdefault("namespace", self.namespace)
        name = meta["name"]
        try:
            created = self._call(
                self.custom.create_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                body,
                _preload_content=False,
            )
        except ApiException as err:
            if err.status == 409:
                raise JobExistsError(name, self.where) from None
            raise JaxpsError(f"TrainingJob {name}: {_reason(err)}") from None
        return Job.of(_json(created))

    def get(self, name: str, *, timeout: float | None = None) -> Job:
        try:
            raw = self._call(
                self.custom.get_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                name,
                _preload_content=False,
                timeout=timeout,
            )
        except ApiException as err:
            if err.status == 404:
                raise JobNotFoundError(name, self.where) from None
            raise JaxpsError(f"TrainingJob {name}: {_reason(err)}") from None
        return Job.of(_json(raw))

    def list(self) -> builtins.list[Job]:
        raw = self._call(
            self.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            _preload_content=False,
        )
        return sorted((Job.of(item) for item in _json(raw)["items"]), key=lambda j: j.name)

    def delete(self, name: str, *, wait: bool) -> None:
        try:
            self._call(
                self.custom.delete_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                name,
                propagation_policy="Foreground",
            )
        except ApiException as err:
            if err.status == 404:
                raise JobNotFoundError(name, self.where) from None
            raise JaxpsError(f"TrainingJob {name}: {_reason(err)}") from None
        if not wait:
            return
        deadline = time.monotonic() + GONE_SECONDS
        while time.monotonic() < deadline:
            try:
                self.get(name)
            except JobNotFoundError:
                if not self.pods(name):
                    return
            time.sleep(0.5)
        raise JaxpsError(f"TrainingJob {name}: still there {GONE_SECONDS:g} s after delete")

    def scale(self, name: str, workers: int) -> None:
        """Through the job's scale subresource, as `kubectl scale` and a HorizontalPodAutoscaler
        change it; the API server's refusal (the CRD's rules) is a `ScaleRefusedError`."""
        try:
            self._call(
                self.custom.patch_namespaced_custom_object_scale,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                name,
                {"spec": {"replicas": workers}},
                _preload_content=False,
            )
        except ApiException as err:
            if err.status == 404:
                raise JobNotFoundError(name, self.where) from None
            if err.status in (400, 422):
                raise ScaleRefusedError(name, workers, _reason(err)) from None
            raise JaxpsError(f"TrainingJob {name}: {_reason(err)}") from None

    def events(self, name: str) -> builtins.list[Event]:
        found = self._call(
            self.core.list_namespaced_event,
            self.namespace,
            field_selector=f"involvedObject.name={name},involvedObject.kind=TrainingJob",
        )
        out = [
            Event(
                type=e.type or "",
                reason=e.reason or "",
                message=e.message or "",
                time=e.last_timestamp or e.event_time or e.first_timestamp,
                count=e.count or 1,
            )
            for e in found.items
        ]
        return sorted(out, key=lambda e: e.time or datetime.min.replace(tzinfo=UTC))

    def logs(self, name: str, *, task: str | None, follow: bool) -> Iterator[LogLine]:
        wanted = task_pods(self.get(name).raw, task)
        pods = sorted(set(self.pods(name)) & set(wanted))
        if task is not None and not pods:
            raise JaxpsError(f"TrainingJob {name}: task {task} has no pod now")
        if not follow:
            return iter([line for pod in pods for line in self._log(pod, follow=False)])
        return _merged([lambda p=pod: self._log(p, follow=True) for pod in pods])

    # --- helpers also used by `kubectl jaxps` ------------------------------------------------

    def pods(self, name: str) -> dict[str, dict[str, Any]]:
        """The job's pods by name, as the API returns them."""
        found = self._call(
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=f"{builders.LABEL_JOB}={name}",
            _preload_content=False,
        )
        return {p["metadata"]["name"]: p for p in _json(found)["items"]}

    def metrics(self, pod: Mapping[str, Any]) -> str:
        """A pod's Prometheus metrics, through the API server's pod proxy ('' if unreachable)."""
        container = (pod["spec"].get("containers") or [{}])[0]
        port = builders.template_metrics_port(container)
        try:
            text: str = self._call(
                self.core.connect_get_namespaced_pod_proxy_with_path,
                f"{pod['metadata']['name']}:{port}",
                self.namespace,
                "metrics",
            )
        except ApiException:
            return ""
        return text

    def _log(self, pod: str, *, follow: bool) -> Iterator[LogLine]:
        try:
            stream: Any = self._call(
                self.core.read_namespaced_pod_log,
                pod,
                self.namespace,
                follow=follow,
                _preload_content=False,
                answer=not follow,  # a followed log may be quiet for long
            )
        except ApiException as err:
            yield LogLine(task=pod, text=f"(no log: {_reason(err)})")
            return
        rest = b""
        try:
            for chunk in stream.stream(2**14):
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    yield LogLine(task=pod, text=line.decode(errors="replace"))
        except urllib3.exceptions.HTTPError as err:
            raise ServerUnreachableError(self.server, _cause(err, self.timeout)) from None
        if rest:
            yield LogLine(task=pod, text=rest.decode(errors="replace"))

    def _call(
        self,
        method: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        answer: bool = True,
        **kwargs: Any,
    ) -> Any:
        """`method(*args, **kwargs)` of the client within the backend's timeout (or
        `timeout`, when shorter) to connect and, with `answer`, to answer; what urllib3
        raises becomes `ServerUnreachableError`. The server's own answers (ApiException)
        pass through."""
        limit = max(min(self.timeout, timeout if timeout is not None else self.timeout), 0.1)
        try:
            return method(*args, _request_timeout=(limit, limit if answer else None), **kwargs)
        except urllib3.exceptions.HTTPError as err:
            raise ServerUnreachableError(self.server, _cause(err, limit)) from None


def _merged(sources: list[Any]) -> Iterator[LogLine]:
    """Lines of several followed streams as they come, one thread per stream; a stream's
    error (the server went away) is raised here, in the reader's thread."""
    lines: queue.Queue[LogLine | JaxpsError | None] = queue.Queue(maxsize=1024)

    def pump(source: Any) -> None:
        try:
            for line in source():
                lines.put(line)
        except JaxpsError as err:
            lines.put(err)
        finally:
            lines.put(None)

    for source in sources:
        threading.Thread(target=pump, args=(source,), daemon=True).start()
    running = len(sources)
    while running:
        line = lines.get()
        if line is None:
            running -= 1
        elif isinstance(line, JaxpsError):
            raise line
        else:
            yield line


def _cause(err: urllib3.exceptions.HTTPError, timeout: float) -> str:
    """Why a request got no answer, in words: `connection refused`, `no answer within 30 s`."""
    reason = getattr(err, "reason", None) or err  # MaxRetryError wraps the last error
    text = str(reason)
    # first: urllib3 makes a refused connection a kind of ConnectTimeoutError
    if isinstance(reason, urllib3.exceptions.NewConnectionError):
        errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)  # [Errno 111] Connection refused
        return errno.group(1).strip().lower() if errno else text
    if isinstance(reason, urllib3.exceptions.ConnectTimeoutError):
        return f"no connection within {round(timeout, 1):g} s (connect timeout)"
    if isinstance(reason, urllib3.exceptions.ReadTimeoutError):
        return f"no answer within {round(timeout, 1):g} s (read timeout)"
    return text


def _json(response: Any) -> Any:
    return json.loads(response.data)


def _reason(err: ApiException) -> str:
    try:
        return str(json.loads(err.body or "").get("message") or err.reason)
    except (TypeError, ValueError):
        return f"{err.status} {err.reason}"
