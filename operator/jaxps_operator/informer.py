"""List and watch one kind of object: client-go's reflector, in a thread.

An `Informer` lists the objects (in pages), then watches from the list's resourceVersion with
bookmarks, and hands every change to `on_event(type, object)` as ADDED, MODIFIED or DELETED.
When the watch ends it is opened again from the last version seen; when that version is too old
(410 Gone) or the connection broke, it lists again, and an object the new list lacks is handed
on as DELETED (a deletion during the gap is never lost, unlike a bare re-list). Until its first
list is done `synced` is unset, so readers of what it fed know whether it is complete.

It keeps each object's resourceVersion and labels only, not the object: what to keep is its
caller's choice (`kube.KubeCluster` keeps a job's pods, slimmed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxps_operator.apiserver import Api, ApiError

SERVER_TIMEOUT = 240  # seconds the API server keeps a watch open
SILENCE = 300.0  # seconds without a byte (bookmarks come every minute) before it is reopened
PAGE = 500
BACKOFF = (0.2, 5.0)  # first and longest pause before a failed list or watch is tried again
ABSENT = 30.0  # seconds between looks for a kind the API server does not serve
log = logging.getLogger("jaxps.operator")

Handler = Callable[[str, dict[str, Any]], None]


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


class Informer:
    """One kind at one path (a namespace's or the cluster's), optionally by label selector."""

    def __init__(
        self,
        api: Api,
        path: str,
        on_event: Handler,
        *,
        selector: str | None = None,
        accept: Callable[[str], bool] = lambda _: True,
    ) -> None:
        """`accept(namespace)`: which objects to hand on (namespace globs on a cluster watch)."""
        self.api = api
        self.path = path
        self.on_event = on_event
        self.selector = selector
        self.accept = accept
        self.synced = threading.Event()
        # (namespace, name) -> (resourceVersion, labels) of every object handed on
        self._versions: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}
        self._version: str | None = None
        self._stopped = threading.Event()
        self._missing = False
        self._thread = threading.Thread(target=self._run, name=f"watch {path}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        pause = BACKOFF[0]
        while not self._stopped.is_set():
            try:
                if self._version is None:
                    self._list()
                self._watch()
                pause = BACKOFF[0]
            except ApiError as err:
                if err.status == 410:
                    self._version = None  # too old: list again, at once
                    continue
                if err.status == 404:  # no such kind (yet): Kueue, say, is not installed
                    if not self._missing:
                        log.info("%s is not served; looking again every %.0f s", self.path, ABSENT)
                    self._missing = True
                    self._stopped.wait(ABSENT)
                    continue
                log.warning("watching %s: %s; again in %.1f s", self.path, err, pause)
                self._stopped.wait(pause)
                pause = min(pause * 2, BACKOFF[1])
            except Exception as err:  # broken, cut, silent or garbled: list again (never die)
                log.warning("watching %s: %s; again in %.1f s", self.path, err, pause)
                self._version = None
                self._stopped.wait(pause)
                pause = min(pause * 2, BACKOFF[1])

    def _list(self) -> None:
        seen: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}
        token: str | None = None
        while True:
            page = self.api.call(
                "GET",
                self.path,
                query={"labelSelector": self.selector, "limit": PAGE, "continue": token},
            )
            for obj in page.get("items") or []:
                key = _key(obj)
                if not self.accept(key[0]):
                    continue
                version = str(obj["metadata"].get("resourceVersion", ""))
                seen[key] = (version, dict(obj["metadata"].get("labels") or {}))
                if key not in self._versions or self._versions[key][0] != version:
                    self._hand("ADDED" if key not in self._versions else "MODIFIED", obj)
            token = (page.get("metadata") or {}).get("continue") or None
            if token is None:
                self._version = str(page["metadata"]["resourceVersion"])
                break
        for key in set(self._versions) - set(seen):  # gone while no watch was open
            labels = self._versions[key][1]
            meta = {"namespace": key[0], "name": key[1], "labels": labels}
            self._hand("DELETED", {"metadata": meta})
        self._versions = seen
        self.synced.set()

    def _watch(self) -> None:
        events = self.api.stream(
            self.path,
            query={
                "watch": "true",
                "resourceVersion": self._version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": SERVER_TIMEOUT,
                "labelSelector": self.selector,
            },
            timeout=SILENCE,
        )
        for event in events:
            if self._stopped.is_set():
                return
            type_, obj = event.get("type"), event.get("object") or {}
            if type_ == "ERROR":
                raise ApiError(int(obj.get("code") or 500), str(obj.get("reason")), "")
            self._version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            if type_ == "BOOKMARK":
                continue
            key = _key(obj)
            if not self.accept(key[0]):
                continue
            if type_ == "DELETED":
                self._versions.pop(key, None)
            else:
                labels = dict((obj.get("metadata") or {}).get("labels") or {})
                self._versions[key] = (self._version, labels)
            self._hand(str(type_), obj)

    def _hand(self, type_: str, obj: dict[str, Any]) -> None:
        try:
            self.on_event(type_, obj)
        except Exception:  # one handler's fault stops no watch
            log.exception("handling %s %s/%s", type_, *_key(obj))


def wait_synced(informers: list[Informer], timeout: float) -> bool:
    """Whether every informer's first list was done within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    return all(i.synced.wait(max(0.0, deadline - time.monotonic())) for i in informers)
