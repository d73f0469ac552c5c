"""Kueue's API on the API server: the `reconcile.Workloads` port, through the official client.

Only `kueue.x-k8s.io/v1beta2`, the stored version: v1beta1 requests need Kueue's conversion
webhook and fail while Kueue is down (research/kueue.md, section 0). Writes send the whole
object with the resourceVersion read (a 409 repeats the pass); a status is written with PUT
`/status`, so `status.admission` can be removed (an apply under another field manager could
not). Kueue's webhooks are failurePolicy Fail: while Kueue restarts they refuse, the pass
fails and the work queue tries again with backoff.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from jaxps_operator import builders, kueue
from jaxps_operator.kube import foreign, namespaced
from jaxps_operator.kubeclient import Api, ApiError
from jaxps_operator.reconcile import ConflictError, NameTakenError

PLURAL = "workloads"
CRD = f"{PLURAL}.{kueue.GROUP}"
API = f"{kueue.GROUP}/{kueue.VERSION}"


class KubeWorkloads:
    """`reconcile.Workloads` on one API server. Thread-safe."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def _missing_api(self) -> bool:
        """Whether Kueue's Workload CRD is absent (a 404 then means no API, not no object)."""
        try:
            self.api.call("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD}")
        except ApiError as err:
            if err.status == 404:
                return True
            raise
        return False

    def get(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        namespace = job["metadata"]["namespace"]
        try:
            wl: dict[str, Any] = self.api.call(
                "GET", namespaced(namespace, PLURAL, kueue.workload_name(job), group=API)
            )
        except ApiError as err:
            if err.status != 404:
                raise
            if self._missing_api():
                raise kueue.UnavailableError(
                    f"Kueue is not installed on this cluster (no {CRD} CRD): the job waits "
                    f"for it, or remove the label {kueue.QUEUE_LABEL}"
                ) from err
            return None
        why = foreign(wl, job)
        if why is not None:  # never adopted, changed or deleted: the job fails NameTaken
            raise NameTakenError(f"Workload {kueue.workload_name(job)} {why}")
        return wl

    def priority(self, group: str, kind: str, name: str) -> int | None:
        try:
            if kind == kueue.WORKLOAD_PRIORITY[1]:
                found = self.api.call("GET", f"/apis/{API}/workloadpriorityclasses/{name}")
            else:
                found = self.api.call("GET", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return int(found.get("value") or 0)

    def flavors(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(set(names)):
            try:
                flavor = self.api.call("GET", f"/apis/{API}/resourceflavors/{name}")
            except ApiError as err:
                if err.status == 404:
                    continue
                raise
            out[name] = dict(flavor.get("spec") or {})
        return out

    def orphans(self, namespace: str, name: str) -> list[dict[str, Any]]:
        try:
            found = self.api.call(
                "GET",
                namespaced(namespace, PLURAL, group=API),
                query={"labelSelector": f"{builders.LABEL_JOB}={name}"},
            )
        except ApiError as err:
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
        collection = namespaced(namespace, PLURAL, group=API)
        try:
            if action.verb == "create":
                self.api.call("POST", collection, body=body)
            elif action.verb == "update":
                self.api.call("PUT", f"{collection}/{name}", body=body)
            elif action.verb == "status":
                self.api.call("PUT", f"{collection}/{name}/status", body=body)
            elif action.verb == "delete":
                self.api.call(
                    "DELETE",
                    f"{collection}/{name}",
                    body={
                        "kind": "DeleteOptions",
                        "apiVersion": "v1",
                        "preconditions": {"uid": meta.get("uid")},
                    },
                )
            else:
                raise ValueError(f"unknown Workload action {action.verb!r}")
        except ApiError as err:
            if err.status == 409:
                if action.verb == "create":
                    return  # made by an earlier pass: read on the next
                raise ConflictError(f"Workload {name} changed while it was reconciled") from err
            if err.status == 404 and action.verb != "create":
                return  # gone: the next pass sees it
            raise
