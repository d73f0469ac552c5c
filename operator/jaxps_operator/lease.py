"""Which of several operator replicas works: a coordination.k8s.io Lease, as client-go elects.

    jaxps operator --peering NAME

Every replica watches; only the holder of the Lease NAME (in the operator's own namespace)
runs passes. The holder renews it every RENEW seconds; a replica takes it over when the record
has not changed for DURATION seconds by its own clock (client-go's rule: no two clocks are
compared), with a write guarded by the resourceVersion it read, so of two contenders one wins
and the other reads 409. A holder that could not renew for RENEW_DEADLINE seconds stops working
before anyone may take over (RENEW_DEADLINE < DURATION); one that stops hands the Lease back
(an empty holder), so a standby takes over at once rather than after DURATION.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

from jaxps_operator.apiserver import SERVICE_ACCOUNT, Api, ApiError

DURATION = 15
RENEW_DEADLINE = 10.0
RENEW = 2.0
log = logging.getLogger("jaxps.operator")


def own_namespace() -> str:
    """POD_NAMESPACE (the chart sets it), else the service account's, else `default`."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    path = SERVICE_ACCOUNT / "namespace"
    return path.read_text().strip() if path.exists() else "default"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Leader:
    """Holds (or waits for) one Lease in a thread; `leading` is set while this replica holds it."""

    def __init__(self, api: Api, *, namespace: str, name: str, identity: str) -> None:
        self.api = api
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.name = name
        self.identity = identity
        self.leading = threading.Event()
        self._stopped = threading.Event()
        self._observed: tuple[str, float] = ("", time.monotonic())  # (resourceVersion, when)
        self._renewed = 0.0
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops renewing and hands the Lease back if held."""
        self._stopped.set()
        self._thread.join(timeout=RENEW * 2)
        if self.leading.is_set():
            self.leading.clear()
            try:
                lease = self.api.call("GET", f"{self.path}/{self.name}")
                if lease["spec"].get("holderIdentity") == self.identity:
                    lease["spec"]["holderIdentity"] = ""
                    lease["spec"]["leaseDurationSeconds"] = 1
                    self.api.call("PUT", f"{self.path}/{self.name}", body=lease)
            except Exception as err:  # it expires by itself, DURATION seconds on
                log.warning("handing back Lease %s: %s", self.name, err)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                held = self._try()
            except Exception as err:  # the API's refusal, a broken connection: try again
                log.warning("Lease %s: %s", self.name, err)
                held = False
            if held:
                self._renewed = time.monotonic()
                if not self.leading.is_set():
                    log.info("Lease %s: %s leads", self.name, self.identity)
                    self.leading.set()
            elif self.leading.is_set() and time.monotonic() - self._renewed > RENEW_DEADLINE:
                log.warning("Lease %s: not renewed for %.0f s; pausing", self.name, RENEW_DEADLINE)
                self.leading.clear()
            self._stopped.wait(RENEW)

    def _try(self) -> bool:
        """One round: create, renew or take over the Lease; whether this replica holds it."""
        try:
            lease: dict[str, Any] = self.api.call("GET", f"{self.path}/{self.name}")
        except ApiError as err:
            if err.status != 404:
                raise
            return self._write("POST", self.path, self._record(None, transitions=0))
        spec = lease.get("spec") or {}
        version = str(lease["metadata"].get("resourceVersion", ""))
        if version != self._observed[0]:
            self._observed = (version, time.monotonic())
        holder = spec.get("holderIdentity") or ""
        expired = time.monotonic() - self._observed[1] > float(
            spec.get("leaseDurationSeconds") or DURATION
        )
        if holder and holder != self.identity and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
        lease["spec"] = self._record(spec if holder == self.identity else None, transitions)
        return self._write("PUT", f"{self.path}/{self.name}", lease)

    def _record(self, held: dict[str, Any] | None, transitions: int) -> dict[str, Any]:
        now = _now()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": DURATION,
            "acquireTime": (held or {}).get("acquireTime") or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _write(self, method: str, path: str, body: dict[str, Any]) -> bool:
        if method == "POST":
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name},
                "spec": body,
            }
        try:
            written = self.api.call(method, path, body=body)
        except ApiError as err:
            if err.status == 409:  # another replica wrote first
                return False
            raise
        self._observed = (str(written["metadata"].get("resourceVersion", "")), time.monotonic())
        return True
