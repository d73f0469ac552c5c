"""The operator: kopf watches, a work queue, and the reconcile pass on the API server.

    jaxps operator [--namespace NS ...] [--peering NAME]

kopf (DESIGN.md) lists and watches the TrainingJobs and the pods, Services and Workloads
labelled with `jaxps.dev/job-name` (a server-side label selector: no other pod is listed),
resumes its watches, re-lists after 410 Gone, serves the liveness endpoint and runs the
process's life: start, SIGTERM, cleanup. Only its stateless handlers are used
(`@kopf.index`, `@kopf.on.event`, `on.startup`, `on.cleanup`, `on.probe`), so kopf writes
nothing to any object: no finalizer, no annotation, no status. The pods of each job are a kopf
index; each event only puts the job's key on a work queue.

Worker threads take a key at a time, never the same key twice at once, and run one
level-based pass each: `reconcile.reconcile` on `kube.KubeCluster`, the same pass `jaxps local`
runs, the only writer, once per pass. Every call goes through the official client
(`kubeclient`). Events that arrive during a pass queue the key again; a Plan's `requeue_after`
(deadline, TTL) and the progress interval are real timers; a pass that fails is tried again
after a per-key exponential backoff with jitter (`workqueue`), which a successful pass resets.
The status is written with the resourceVersion that was read, so a concurrent change (409)
just repeats the pass (0.1 s later; a conflict is no failure). Pods are created with
deterministic names, so a create that answers 409 is success and a restarted operator creates
no duplicates. With `--peering`, every replica watches and only the holder of a
coordination.k8s.io Lease runs passes (the client's leader election: `Leader`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from jaxps_operator import builders, kube, kubeclient, kueue, kueue_api, reconcile
from jaxps_operator.conditions import STATES
from jaxps_operator.workqueue import Key, WorkQueue
from jaxps_runtime.process import malloc

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


# --- the Lease -----------------------------------------------------------------------------------

# A standby takes over once the holder's record has not changed for LEASE_DURATION seconds by
# its own clock (checked every RETRY): after a holder is killed, at most LEASE_DURATION + 2 RETRY.
# A holder that cannot renew for RENEW_DEADLINE seconds stops before anyone may take over.
LEASE_DURATION = 10
RENEW_DEADLINE = 7
RETRY = 2


def identity() -> str:
    """This replica's name among peers: the pod's name (the chart's POD_ID), else host and pid."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}-{os.getpid()}"


def own_namespace() -> str:
    """POD_NAMESPACE (the chart sets it), else the service account's, else `default`."""
    return os.environ.get("POD_NAMESPACE") or kubeclient.service_account_namespace() or "default"


class _Lock(LeaseLock):
    """The client's LeaseLock, which writes nothing once `stopped` is set: a Lease handed back
    is not renewed again by a round of the election already under way."""

    def __init__(self, name: str, namespace: str, holder: str, stopped: threading.Event) -> None:
        super().__init__(name, namespace, holder)  # type: ignore[no-untyped-call]
        self.stopped = stopped

    def create(self, name: str, namespace: str, election_record: Any) -> bool:
        if self.stopped.is_set():
            return False
        return bool(super().create(name, namespace, election_record))  # type: ignore[no-untyped-call]

    def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        if self.stopped.is_set():
            return False
        return bool(super().update(name, namespace, updated_record))  # type: ignore[no-untyped-call]


class Leader:
    """The client's leader election (`kubernetes.leaderelection`) on the Lease `name`, in a
    thread: `leading` is set while this replica holds it. A holder that loses it calls `lost`
    (the operator stops and exits, as kube-controller-manager does, and comes back a standby);
    one that stops hands it back, so a standby takes over at once."""

    def __init__(self, api: kubeclient.Api, *, namespace: str, name: str, holder: str) -> None:
        self.api = api
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.name = name
        self.holder = holder
        self.lost: Callable[[], object] = lambda: None
        self.leading = threading.Event()
        self.stopped = threading.Event()
        config = electionconfig.Config(  # type: ignore[no-untyped-call]
            _Lock(name, namespace, holder, self.stopped),
            LEASE_DURATION,
            RENEW_DEADLINE,
            RETRY,
            onstarted_leading=self._lead,
            onstopped_leading=self._lose,
        )
        election = leaderelection.LeaderElection(config)  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=election.run, name="lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _lead(self) -> None:
        log.info("Lease %s: %s leads", self.name, self.holder)
        self.leading.set()

    def _lose(self) -> None:
        if self.stopped.is_set():
            return
        self.leading.clear()
        log.error(
            "Lease %s: not renewed for %d s; %s stops", self.name, RENEW_DEADLINE, self.holder
        )
        self.lost()

    def stop(self) -> None:
        """Stops renewing; hands the Lease back if held."""
        self.stopped.set()
        if not self.leading.is_set():
            return
        self.leading.clear()
        for _ in range(3):  # a renewal already under way may win once (409): read it again
            try:
                lease = self.api.call("GET", self.path)
                if (lease.get("spec") or {}).get("holderIdentity") != self.holder:
                    return
                lease["spec"] |= {"holderIdentity": "", "leaseDurationSeconds": 1}
                self.api.call("PUT", self.path, body=lease)
                log.info("Lease %s: handed back", self.name)
                return
            except kubeclient.ApiError as err:
                if err.status != 409:
                    log.warning("handing back Lease %s: %s", self.name, kubeclient.message_of(err))
                    return
            except Exception as err:  # it expires by itself, LEASE_DURATION seconds on
                log.warning("handing back Lease %s: %s", self.name, err)
                return


# --- kopf: the watches, the index of pods, the probe, the life of the process --------------------


def _deleted(event: kopf.RawEvent, **_: Any) -> bool:
    return event["type"] == "DELETED"


class _NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """No handler here detects changes, so no essence of an object is built or kept (kopf
    built one, a deep copy, per event: half of its cost per event)."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> Any:
        return None


def settings(options: Options) -> kopf.OperatorSettings:
    """kopf as the operator uses it: pods, Services and Workloads selected by the job label on
    the API server; nothing posted or stored by kopf itself."""
    found = kopf.OperatorSettings()
    found.posting.enabled = False  # Events are the pass's, not kopf's log lines
    found.persistence.diffbase_storage = _NoDiffBase()
    for kind in (("v1", "pods"), ("v1", "services"), (kueue.GROUP, kueue_api.PLURAL)):
        found.watching.label_selectors[kind] = builders.LABEL_JOB
    return found


def kopf_namespaces(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """kopf's namespaces for `--namespace` patterns: names as they are (a watch each, even
    where namespaces cannot be listed); with globs or exclusions (`team-*`, `!team-x`), one kopf
    pattern per inclusive glob with every exclusion after it (kopf ORs its patterns, and in
    one pattern only the first inclusive glob includes), so an exclusion holds against all."""
    if not any(set(p) & set("*?!,") for p in patterns):
        return patterns
    parts = [part.strip() for p in patterns for part in p.split(",") if part.strip()]
    exclude = [p for p in parts if p.startswith("!")]
    include = [p for p in parts if not p.startswith("!")] or ["*"]
    return tuple(",".join([glob, *exclude]) for glob in include)


def register(
    registry: kopf.OperatorRegistry,
    controller: Controller,
    cluster: kube.KubeCluster,
    leader: Leader | None,
) -> None:
    """The handlers: each event only updates what a pass reads and puts the job on the queue."""
    options = controller.options

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # the client's loaders, as `kubeclient.load`: in a pod its service account, else the
        # kubeconfig (exec plugins included); kopf logs in again after a 401 (a new token)
        return kopf.login_via_client(**kwargs)

    # Pods, Services and Workloads come selected by the job label on the API server
    # (`settings`), so no handler filters them again. A pod's ADDED and MODIFIED are handled by
    # the index alone (one handler per event, not two); its DELETED, which kopf's index drops
    # without a handler, by `pod_deleted`. The job is queued once kopf has stored the index's
    # answer: on the loop's next turn, after this event's processing (kopf stores it without
    # yielding), so a pass never reads the pod from before the event.
    @kopf.index("v1", "pods", id="pods_by_job", registry=registry)
    async def pods_by_job(
        *, namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
    ) -> dict[Key, dict[str, Any]]:
        key = (namespace or "", labels[builders.LABEL_JOB])
        pod = kube.slim_pod(body)
        asyncio.get_running_loop().call_soon(_pod_seen, key, "MODIFIED", pod)
        return {key: pod}

    @kopf.on.event("v1", "pods", when=_deleted, registry=registry)
    async def pod_deleted(
        *, event: kopf.RawEvent, namespace: str | None, labels: Mapping[str, str], **_: Any
    ) -> None:
        _pod_seen((namespace or "", labels[builders.LABEL_JOB]), "DELETED", event["object"])

    def _pod_seen(key: Key, type_: str, pod: Mapping[str, Any]) -> None:
        cluster.pod_event(type_, pod)
        controller.touch(key)

    @kopf.on.event(kube.GROUP, kube.VERSION, kube.PLURAL, registry=registry)
    async def job_event(
        *, event: kopf.RawEvent, namespace: str | None, name: str, **_: Any
    ) -> None:
        key = (namespace or "", name)
        cluster.seen(event["type"], event["object"])
        if event["type"] == "DELETED":
            controller.forget(key)
        else:
            controller.touch(key)

    @kopf.on.event("v1", "services", registry=registry)
    async def service_event(
        *, event: kopf.RawEvent, namespace: str | None, labels: Mapping[str, str], **_: Any
    ) -> None:
        if event["type"] == "DELETED":
            cluster.child_deleted(namespace or "", labels[builders.LABEL_JOB])
        controller.touch((namespace or "", labels[builders.LABEL_JOB]))

    if options.kueue:  # Kueue admits, evicts and requeues through the Workload: a pass each

        @kopf.on.event(kueue.GROUP, kueue.VERSION, kueue_api.PLURAL, registry=registry)
        async def workload_event(
            *, namespace: str | None, labels: Mapping[str, str], **_: Any
        ) -> None:
            controller.touch((namespace or "", labels[builders.LABEL_JOB]))

    @kopf.on.startup(registry=registry)
    async def start(**kwargs: Any) -> None:
        pods_by_job: kopf.Index[Key, dict[str, Any]] = kwargs["pods_by_job"]

        def pods(namespace: str, job: str) -> list[dict[str, Any]]:
            # list() of a kopf Store copies its dict's values in one step, safe from a thread
            return list(pods_by_job.get((namespace, job), ()))

        cluster.pod_index = pods
        if leader is not None:
            leader.start()
        controller.start()
        log.info(
            "jaxps operator: watching %s with %d workers%s",
            ", ".join(options.namespaces) or "every namespace",
            options.workers,
            f", as {leader.holder} among the replicas of Lease {leader.name}" if leader else "",
        )

    @kopf.on.probe(id="jobs", registry=registry)
    async def jobs(**_: Any) -> int:
        return len(controller.states)

    @kopf.on.probe(id="queued", registry=registry)
    async def queued(**_: Any) -> int:
        return len(controller.queue)

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        log.info("jaxps operator: stopping")
        if leader is not None:
            await asyncio.to_thread(leader.stop)
        await asyncio.to_thread(controller.stop)


def fewer_arenas(environ: Mapping[str, str], arenas: int = 2) -> bool:
    """glibc gives each thread that allocates its own malloc arena, whose freed pages stay
    resident; the operator's threads (workers, child calls, reads, kopf's loop) made tens of
    megabytes of them. M_ARENA_MAX (what MALLOC_ARENA_MAX sets) bounds them, unless the user
    tuned malloc in `environ` or the libc is not glibc (`malloc.tune`: False then)."""
    return malloc.tune({malloc.M_ARENA_MAX: arenas}, environ)


def run(options: Options) -> int:
    """Runs the operator until SIGTERM or SIGINT (0), or until it loses its Lease (1)."""
    fewer_arenas(os.environ)
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] %(name)-20s [%(levelname)-8s] %(message)s"
    )
    # kopf's line per handled event, the election's per round and one per probe: noise
    for quiet in ("kopf", "leaderelection", "aiohttp.access"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    api = kubeclient.Api(kubeclient.load(pod_first=True, default=True).configuration)
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
    # set when the Lease is lost: an asyncio.Event of kopf's loop (kopf waits on a threading
    # Event or a concurrent Future in a thread of the loop's executor, which then kept the
    # process from exiting after SIGTERM)
    lost = asyncio.Event()
    leader = None
    if options.peering is not None:
        leader = Leader(
            api,
            namespace=own_namespace(),
            name=options.peering,
            holder=identity(),
        )
        controller.leading = leader.leading
    cluster.on_gone = lambda namespace, name: controller.touch((namespace, name))
    registry = kopf.OperatorRegistry()
    register(registry, controller, cluster, leader)
    if options.metrics_port is not None:
        start_http_server(options.metrics_port, registry=metrics.registry)
    # What is loaded by now lives as long as the process: out of the collector's sight, so a
    # full collection walks only what the watches and passes made.
    gc.freeze()
    # A watch event decodes into hundreds of containers, nearly all freed by their count: at
    # the default 700 allocations a young collection ran several times per event, for cycles
    # that are rare here
    gc.set_threshold(20_000, 10, 10)

    async def operate() -> None:
        if leader is not None:
            loop = asyncio.get_running_loop()
            leader.lost = lambda: loop.call_soon_threadsafe(lost.set)
        await kopf.operator(
            registry=registry,
            settings=settings(options),
            standalone=True,  # no kopf peering: the Lease elects (`Leader`)
            clusterwide=not options.namespaces,
            namespaces=kopf_namespaces(options.namespaces),
            liveness_endpoint=options.liveness,
            stop_flag=lost,
        )

    asyncio.run(operate())
    return 1 if lost.is_set() else 0
