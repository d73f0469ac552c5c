"""Kueue's API on the API server: the `reconcile.Workloads` port, through the official client.

Only `kueue.x-k8s.io/v1beta2`, the stored version: v1beta1 requests need Kueue's conversion
webhook and fail while Kueue is down (research/kueue.md, section 0). Writes send the whole
object with the resourceVersion read (a 409 repeats the pass); a status is written with PUT
`/status`, so `status.admission` can be removed (an apply under another field manager could
not). Kueue's webhooks are failurePolicy Fail: while Kueue restarts they refuse, the pass
fails and the work queue tries again with backoff.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from jaxps_operator import builders, kueue
from jaxps_operator.kube import released
from jaxps_operator.reconcile import ConflictError

PLURAL = "workloads"
CRD = f"{PLURAL}.{kueue.GROUP}"


def _json(response: Any) -> Any:
    return json.loads(response.data)


class KubeWorkloads:
    """`reconcile.Workloads` on the API server the client is configured for. Thread-safe."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.client = api_client or client.ApiClient()
        self.custom = client.CustomObjectsApi(self.client)
        self.scheduling = client.SchedulingV1Api(self.client)
        self.extensions = client.ApiextensionsV1Api(self.client)

    def _missing_api(self) -> bool:
        """Whether Kueue's Workload CRD is absent (a 404 then means no API, not no object)."""
        try:
            released(self.extensions.read_custom_resource_definition(CRD, _preload_content=False))
        except ApiException as err:
            if err.status == 404:
                return True
            raise
        return False

    def get(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        namespace = job["metadata"]["namespace"]
        try:
            wl: dict[str, Any] = _json(
                self.custom.get_namespaced_custom_object(
                    kueue.GROUP,
                    kueue.VERSION,
                    namespace,
                    PLURAL,
                    kueue.workload_name(job),
                    _preload_content=False,
                )
            )
        except ApiException as err:
            if err.status != 404:
                raise
            if self._missing_api():
                raise kueue.UnavailableError(
                    f"Kueue is not installed on this cluster (no {CRD} CRD): the job waits "
                    f"for it, or remove the label {kueue.QUEUE_LABEL}"
                ) from err
            return None
        return wl

    def priority(self, group: str, kind: str, name: str) -> int | None:
        try:
            if kind == kueue.WORKLOAD_PRIORITY[1]:
                found = _json(
                    self.custom.get_cluster_custom_object(
                        kueue.GROUP,
                        kueue.VERSION,
                        "workloadpriorityclasses",
                        name,
                        _preload_content=False,
                    )
                )
            else:
                found = _json(self.scheduling.read_priority_class(name, _preload_content=False))
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return int(found.get("value") or 0)

    def flavors(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(set(names)):
            try:
                flavor = _json(
                    self.custom.get_cluster_custom_object(
                        kueue.GROUP,
                        kueue.VERSION,
                        "resourceflavors",
                        name,
                        _preload_content=False,
                    )
                )
            except ApiException as err:
                if err.status == 404:
                    continue
                raise
            out[name] = dict(flavor.get("spec") or {})
        return out

    def orphans(self, namespace: str, name: str) -> list[dict[str, Any]]:
        try:
            found = _json(
                self.custom.list_namespaced_custom_object(
                    kueue.GROUP,
                    kueue.VERSION,
                    namespace,
                    PLURAL,
                    label_selector=f"{builders.LABEL_JOB}={name}",
                    _preload_content=False,
                )
            )
        except ApiException as err:
            if err.status == 404:  # no Kueue: no Workloads
                return []
            raise
        return [
            wl
            for wl in found.get("items") or []
            if kueue.FINALIZER in (wl["metadata"].get("finalizers") or [])
        ]

    def apply(self, action: kueue.Action) -> None:
        body = action.body
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        args = (kueue.GROUP, kueue.VERSION, namespace, PLURAL)
        try:
            if action.verb == "create":
                released(
                    self.custom.create_namespaced_custom_object(*args, body, _preload_content=False)
                )
            elif action.verb == "update":
                released(
                    self.custom.replace_namespaced_custom_object(
                        *args, name, body, _preload_content=False
                    )
                )
            elif action.verb == "status":
                released(
                    self.custom.replace_namespaced_custom_object_status(
                        *args, name, body, _preload_content=False
                    )
                )
            elif action.verb == "delete":
                released(
                    self.custom.delete_namespaced_custom_object(
                        *args,
                        name,
                        body=client.V1DeleteOptions(
                            preconditions=client.V1Preconditions(uid=meta.get("uid"))
                        ),
                        _preload_content=False,
                    )
                )
            else:
                raise ValueError(f"unknown Workload action {action.verb!r}")
        except ApiException as err:
            if err.status == 409:
                if action.verb == "create":
                    return  # made by an earlier pass: read on the next
                raise ConflictError(f"Workload {name} changed while it was reconciled") from err
            if err.status == 404 and action.verb != "create":
                return  # gone: the next pass sees it
            raise
