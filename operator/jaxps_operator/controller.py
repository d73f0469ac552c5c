"""The operator: watches, a work queue, and the reconcile pass on the API server.

    jaxps operator [--namespace NS ...] [--peering NAME]

`informer.Informer`s list and watch the TrainingJobs and the pods, Services and Workloads
labelled with `jaxps.dev/job-name`, each in a thread of its own; each event only puts the job's
key on a work queue (and keeps the job's body and its pods for the passes to read: `kube`).
Worker threads take a key at a time, never the same key twice at once, and run one
level-based pass each: `reconcile.reconcile` on `kube.KubeCluster`, the same pass `jaxps local`
runs. Threads, as client-go's controllers are built, not an event loop: an event reaches its
pass through one lock and one wake-up (through a loop and a thread pool it was two hops).

Events that arrive during a pass queue the key again; a Plan's `requeue_after` (deadline, TTL)
and the progress interval are real timers; a pass that fails is tried again after a per-key
exponential backoff with jitter (`workqueue`), which a successful pass resets. The status is
written with the resourceVersion that was read, so a concurrent change (409) just repeats the
pass (0.1 s later; a conflict is no failure). Pods are created with deterministic names, so a
create that answers 409 is success and a restarted operator creates no duplicates. With
`--peering`, only the replica that holds the Lease runs passes (`lease`).

This replaced kopf and the official client (DESIGN.md's first operator): their imports alone
made the process larger than Kubeflow's whole operator, and kopf's per-event machinery, with a
LIST of the job's pods per pass, used four times its CPU. What kopf gave that is kept: the
watches with bookmarks and re-lists, the liveness endpoint, several replicas of which one works.
"""

from __future__ import annotations

import fnmatch
import gc
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from jaxps_operator import (
    apiserver,
    builders,
    informer,
    kube,
    kueue,
    kueue_api,
    lease,
    reconcile,
)
from jaxps_operator.conditions import STATES
from jaxps_operator.workqueue import Key, WorkQueue

PREFIX = "jaxps.dev"
CHILD_CALLS = 8  # creates or deletes of one pass in flight at once
log = logging.getLogger("jaxps.operator")


@dataclass(frozen=True)
class Options:
    namespaces: tuple[str, ...] = ()  # () watches every namespace
    workers: int = 4
    progress_interval: float = 10.0  # seconds between reads of a running chief's metrics
    resync_interval: float = 300.0  # every job is reconciled at least this often
    metrics_port: int | None = 8000
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    peering: str | None = None  # the Lease that elects the working replica; None: standalone
    image: str = builders.DEFAULT_IMAGE  # the runtime image of pods whose template names none
    network_policy: bool = True  # a NetworkPolicy per job: only its own pods reach its pods
    kueue: bool = True  # jobs labelled kueue.x-k8s.io/queue-name wait for Kueue's admission


class Metrics:
    """The operator's own Prometheus metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge(
            "jaxps_operator_jobs", "TrainingJobs by state", ["state"], registry=self.registry
        )
        self.replacements = Counter(
            "jaxps_operator_pod_replacements",
            "Failed pods replaced",
            ["role"],
            registry=self.registry,
        )
        self.reconcile = Histogram(
            "jaxps_operator_reconcile_seconds",
            "Time of one reconcile pass",
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.errors = Counter(
            "jaxps_operator_reconcile_errors",
            "Reconcile passes that failed",
            registry=self.registry,
        )
        self.queue = Gauge(
            "jaxps_operator_queue_depth", "Jobs waiting for a pass", registry=self.registry
        )
        for state in STATES:
            self.jobs.labels(state=state).set(0)


# --- one pass (blocking; runs in a worker thread) ------------------------------------------------


@dataclass
class Reconciler:
    """`reconcile.reconcile` on the API server, with the operator's options and metrics."""

    cluster: reconcile.Cluster
    metrics: Metrics
    progress_interval: float = 10.0
    image: str = builders.DEFAULT_IMAGE
    network_policy: bool = True
    workloads: reconcile.Workloads | None = None
    # the apiserver evaluated the CRD's CEL rules when it admitted the job
    validator: reconcile.Validator = field(default_factory=lambda: reconcile.Validator(rules=False))
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(CHILD_CALLS, thread_name_prefix="jaxps-child")
    )

    def reconcile(self, namespace: str, name: str) -> reconcile.Outcome:
        outcome = reconcile.reconcile(
            self.cluster,
            namespace,
            name,
            now=datetime.now(UTC),
            validator=self.validator,
            image=self.image,
            progress_interval=self.progress_interval,
            parallel=self.pool.map,
            network_policy=self.network_policy,
            workloads=self.workloads,
        )
        for role, _ in outcome.replaced:
            self.metrics.replacements.labels(role=role).inc()
        return outcome


@dataclass
class Controller:
    """The workers' state: the queue, the worker threads, what each job's state was last seen
    as. The watch threads add keys; `workers` threads take them and run one pass each."""

    options: Options
    reconciler: Reconciler
    metrics: Metrics
    queue: WorkQueue = field(default_factory=WorkQueue)
    states: dict[Key, str] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)
    leading: threading.Event | None = None  # set while this replica works (None: standalone)
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards states

    def start(self) -> None:
        self.threads = [
            threading.Thread(target=self._worker, name=f"jaxps-worker-{i}", daemon=True)
            for i in range(self.options.workers)
        ]
        self.threads.append(threading.Thread(target=self._resync, name="jaxps-resync", daemon=True))
        for thread in self.threads:
            thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """No pass starts after this; waits up to `timeout` seconds for those running."""
        self.stopped.set()
        self.queue.shut_down()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0.0))

    def touch(self, key: Key) -> None:
        self.queue.add(key)
        self.metrics.queue.set(len(self.queue))

    def forget(self, key: Key) -> None:
        self.queue.forget(key)
        with self.lock:
            self.states.pop(key, None)
            self._count()
        self.reconciler.validator.forget(*key)

    def _count(self) -> None:  # the lock held
        for state in STATES:
            self.metrics.jobs.labels(state=state).set(
                sum(1 for s in self.states.values() if s == state)
            )

    def _resync(self) -> None:
        while not self.stopped.wait(self.options.resync_interval):
            with self.lock:
                keys = list(self.states)
            for key in keys:
                self.touch(key)

    def _worker(self) -> None:
        while True:
            while self.leading is not None and not self.leading.wait(0.2):
                if self.stopped.is_set():  # a standby: keys wait in the queue until it leads
                    return
            key = self.queue.get()
            if key is None:
                return
            self.metrics.queue.set(len(self.queue))
            started = time.perf_counter()
            try:
                self._pass(key)
            finally:
                self.metrics.reconcile.observe(time.perf_counter() - started)
                self.queue.done(key)

    def _pass(self, key: Key) -> None:
        try:
            outcome = self.reconciler.reconcile(*key)
        except reconcile.ConflictError as err:
            log.info("%s: pass repeated", err)
            self.queue.add_after(key, 0.1)
        except kube.ApiError as err:
            self.metrics.errors.inc()
            delay = self.queue.retry(key)
            log.warning(
                "TrainingJob %s/%s: the API answered %s: %s; retrying in %.1f s",
                *key,
                err.status,
                kube.message(err),
                delay,
            )
        except Exception:
            self.metrics.errors.inc()
            delay = self.queue.retry(key)
            log.exception("TrainingJob %s/%s: reconcile failed; retrying in %.1f s", *key, delay)
        else:
            self.queue.succeeded(key)
            if outcome.state is None:
                self.forget(key)
                return
            with self.lock:
                if self.states.get(key) != outcome.state:  # counted again only on a change
                    self.states[key] = outcome.state
                    self._count()
            if outcome.requeue_after is not None:
                self.queue.add_after(key, outcome.requeue_after)


# --- watches, the Lease, the liveness endpoint -------------------------------------------------


def matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """Which namespaces globs like `team-*` (and exclusions like `!team-x`) name; () is all."""
    include = [p for p in patterns if not p.startswith("!")]
    exclude = [p[1:] for p in patterns if p.startswith("!")]

    def accept(namespace: str) -> bool:
        if any(fnmatch.fnmatchcase(namespace, p) for p in exclude):
            return False
        return not include or any(fnmatch.fnmatchcase(namespace, p) for p in include)

    return accept


@dataclass(frozen=True)
class Watched:
    """A kind the operator watches: its API path prefix and plural, and the label it needs."""

    prefix: str  # /api/v1 or /apis/GROUP/VERSION
    plural: str
    selector: str | None

    def paths(self, namespaces: tuple[str, ...]) -> list[str]:
        """One path per namespace when all are named; else the cluster's (globs filter it)."""
        if namespaces and not any(set(ns) & set("*?[!") for ns in namespaces):
            return [f"{self.prefix}/namespaces/{ns}/{self.plural}" for ns in namespaces]
        return [f"{self.prefix}/{self.plural}"]


JOBS = Watched(f"/apis/{kube.API}", kube.PLURAL, None)
PODS = Watched("/api/v1", "pods", builders.LABEL_JOB)
SERVICES = Watched("/api/v1", "services", builders.LABEL_JOB)
WORKLOADS = Watched(f"/apis/{kueue.GROUP}/{kueue.VERSION}", kueue_api.PLURAL, builders.LABEL_JOB)


def informers(
    api: apiserver.Api,
    controller: Controller,
    cluster: kube.KubeCluster,
) -> dict[str, list[informer.Informer]]:
    """The watches of jobs and of their pods, Services and (with Kueue) Workloads; each event
    only puts the job's key on the queue, from the watch's thread."""
    options = controller.options
    accept = matcher(options.namespaces)

    def job_event(type_: str, job: dict[str, Any]) -> None:
        meta = job.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        cluster.seen(type_, job)
        if type_ == "DELETED":
            controller.forget(key)
        else:
            controller.touch(key)

    def child_event(type_: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        job = (meta.get("labels") or {}).get(builders.LABEL_JOB)
        if job:
            controller.touch((str(meta.get("namespace", "")), job))

    def pod_event(type_: str, pod: dict[str, Any]) -> None:
        cluster.pod_seen(type_, pod)
        child_event(type_, pod)

    def service_event(type_: str, service: dict[str, Any]) -> None:
        meta = service.get("metadata") or {}
        job = (meta.get("labels") or {}).get(builders.LABEL_JOB)
        if type_ == "DELETED" and job:
            cluster.child_deleted(str(meta.get("namespace", "")), job)
        child_event(type_, service)

    kinds: list[tuple[str, Watched, informer.Handler]] = [
        ("jobs", JOBS, job_event),
        ("pods", PODS, pod_event),
        ("services", SERVICES, service_event),
    ]
    if options.kueue:  # Kueue admits, evicts and requeues through the Workload: a pass each
        kinds.append(("workloads", WORKLOADS, child_event))
    return {
        name: [
            informer.Informer(api, path, handler, selector=kind.selector, accept=accept)
            for path in kind.paths(options.namespaces)
        ]
        for name, kind, handler in kinds
    }


def serve_liveness(url: str, probe: Callable[[], dict[str, int] | None]) -> ThreadingHTTPServer:
    """GET on the URL's path: 200 and `probe()` as JSON once it answers, else 503."""
    parsed = urllib.parse.urlsplit(url)
    path = parsed.path or "/"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = probe() if self.path == path else None
            code = 404 if self.path != path else 200 if found is not None else 503
            data = json.dumps(found or {}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # not a line per kubelet probe

    server = ThreadingHTTPServer((parsed.hostname or "0.0.0.0", parsed.port or 80), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="liveness", daemon=True).start()
    return server


def identity() -> str:
    """This replica's name among peers: the pod's name (the chart's POD_ID), else host and pid."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}-{os.getpid()}"


def serve(controller: Controller, api: apiserver.Api, cluster: kube.KubeCluster) -> None:
    """Watches, works (while this replica leads) and answers probes until SIGTERM or SIGINT;
    runs in the main thread (where signal handlers are set)."""
    options = controller.options
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    watches = informers(api, controller, cluster)
    cluster.pods_watched = lambda: all(i.synced.is_set() for i in watches["pods"])
    cluster.on_gone = lambda namespace, name: controller.touch((namespace, name))
    leader = None
    if options.peering is not None:
        leader = lease.Leader(
            api, namespace=lease.own_namespace(), name=options.peering, identity=identity()
        )
        controller.leading = leader.leading
        leader.start()
    for watch in (w for ws in watches.values() for w in ws):
        watch.start()

    def probe() -> dict[str, int] | None:
        if not all(w.synced.is_set() for w in watches["jobs"]):
            return None
        return {"jobs": len(controller.states), "queued": len(controller.queue)}

    health = serve_liveness(options.liveness, probe) if options.liveness else None
    controller.start()
    log.info(
        "jaxps operator: watching %s with %d workers%s",
        ", ".join(options.namespaces) or "every namespace",
        options.workers,
        f", as {identity()} among the replicas of Lease {options.peering}" if leader else "",
    )
    while not stopping.wait(1.0):  # a timeout: so the main thread runs the signal handlers
        pass
    log.info("jaxps operator: stopping")
    if health is not None:
        health.shutdown()
    for watch in (w for ws in watches.values() for w in ws):
        watch.stop()
    if leader is not None:
        leader.stop()
    controller.stop()


def run(options: Options) -> None:
    """Runs the operator until SIGTERM or SIGINT."""
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] %(name)-20s [%(levelname)-8s] %(message)s"
    )
    api = apiserver.Api.from_environment()
    metrics = Metrics()
    cluster = kube.KubeCluster(api, network_policies=options.network_policy)
    controller = Controller(
        options=options,
        reconciler=Reconciler(
            cluster=cluster,
            metrics=metrics,
            progress_interval=options.progress_interval,
            image=options.image,
            network_policy=options.network_policy,
            workloads=kueue_api.KubeWorkloads(api) if options.kueue else None,
        ),
        metrics=metrics,
    )
    if options.metrics_port is not None:
        start_http_server(options.metrics_port, registry=metrics.registry)
    # What is loaded by now lives as long as the process: out of the collector's sight, so a
    # full collection walks only what the watches and passes made (it walked every module's
    # objects too, tens of milliseconds added to whichever pass it fell in).
    gc.freeze()
    serve(controller, api, cluster)
