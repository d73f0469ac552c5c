"""A thin, blocking wrapper of the Kubernetes API for the operator: plain dicts in and out.

Every call here blocks on the network, so the controller only makes them from worker threads,
never on kopf's event loop. Creating an object that already exists (409) and deleting one that
is gone (404) count as success: children have deterministic names and a pass may be repeated.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

__all__ = ["Api", "ApiException", "ConflictError", "load_config", "message"]

GROUP, VERSION, PLURAL, KIND = "jaxps.dev", "v1alpha1", "trainingjobs", "TrainingJob"
COMPONENT = "jaxps-operator"


class ConflictError(Exception):
    """The object changed since it was read: the pass is repeated."""


def load_config() -> None:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config()  # type: ignore[no-untyped-call]


def message(err: ApiException) -> str:
    """The apiserver's own words for a refused request."""
    try:
        return str(json.loads(err.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(err.reason)


def _json(response: Any) -> Any:
    return json.loads(response.data)


class Api:
    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.client = api_client or client.ApiClient()
        self.core = client.CoreV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    # --- TrainingJobs -------------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            job: dict[str, Any] = _json(
                self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
                )
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return job

    def replace_job_status(self, job: Mapping[str, Any]) -> None:
        """Writes `job`'s status, guarded by its resourceVersion (409 -> `ConflictError`)."""
        meta = job["metadata"]
        try:
            self.custom.replace_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], dict(job)
            )
        except ApiException as err:
            if err.status == 409:
                raise ConflictError(
                    f"TrainingJob {meta['name']} changed while it was reconciled"
                ) from err
            if err.status == 404:
                return
            raise

    def delete_job(self, namespace: str, name: str) -> None:
        """Deletes the job; the garbage collector deletes its children (owner references)."""
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Background"
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
        try:
            self.core.read_namespaced_service(name, namespace, _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

    def create(self, namespace: str, manifest: Mapping[str, Any]) -> bool:
        """Creates a Pod or Service; False when it already exists."""
        create = (
            self.core.create_namespaced_pod
            if manifest["kind"] == "Pod"
            else self.core.create_namespaced_service
        )
        body: Any = dict(manifest)  # the client takes plain dicts as well as its models
        try:
            create(namespace, body, _preload_content=False)
        except ApiException as err:
            if err.status == 409:
                return False
            raise
        return True

    def delete_pod(self, namespace: str, name: str) -> bool:
        """Deletes a pod; False when it was already gone."""
        try:
            self.core.delete_namespaced_pod(name, namespace, _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

    # --- events -------------------------------------------------------------------------------

    def post_event(self, job: Mapping[str, Any], *, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the TrainingJob (what `kubectl describe tj` shows)."""
        meta = job["metadata"]
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
        self.core.create_namespaced_event(meta["namespace"], body, _preload_content=False)
