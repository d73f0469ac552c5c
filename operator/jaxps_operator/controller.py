"""The operator: kopf watches, a work queue, and the reconcile pass on the API server.

    jaxps operator [--namespace NS ...]

kopf delivers the watch events of TrainingJobs and of the pods and Services labelled with
`jaxps.dev/job-name`; each only puts the job's key on a work queue (stateless `on.event`
handlers: kopf writes nothing on any object). Workers take a key at a time, never the same
key twice at once, and run one level-based pass in a thread, so blocking API calls never stall
the event loop: `reconcile.reconcile` on `kube.KubeCluster`, the same pass `jaxps local` runs.

Events that arrive during a pass queue the key again; a Plan's `requeue_after` (deadline, TTL)
and the progress interval are real timers; a pass that fails is tried again after a per-key
exponential backoff with jitter (`workqueue`), which a successful pass resets. The status is
written with the resourceVersion that was read, so a concurrent change (409) just repeats the
pass (0.1 s later; a conflict is no failure). Pods are created with deterministic names, so a
create that answers 409 is success and a restarted operator creates no duplicates.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from jaxps_operator import builders, kube, kueue, kueue_api, reconcile, schema
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
    peering: str | None = None  # None: standalone (one replica)
    priority: int = 0
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
    validator: reconcile.Validator = field(default_factory=reconcile.Validator)
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
    """The kopf-side state: the queue, the workers, what each job's state was last seen as."""

    options: Options
    reconciler: Reconciler
    metrics: Metrics
    queue: WorkQueue = field(default_factory=WorkQueue)
    states: dict[Key, str] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self._worker(i), name=f"jaxps-worker-{i}")
            for i in range(self.options.workers)
        ]
        self.tasks.append(asyncio.create_task(self._resync(), name="jaxps-resync"))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def touch(self, key: Key) -> None:
        self.queue.add(key)
        self.metrics.queue.set(len(self.queue))

    def forget(self, key: Key) -> None:
        self.queue.forget(key)
        self.states.pop(key, None)
        self.reconciler.validator.forget(*key)
        self._count()

    def _count(self) -> None:
        for state in STATES:
            self.metrics.jobs.labels(state=state).set(
                sum(1 for s in self.states.values() if s == state)
            )

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.options.resync_interval)
            for key in list(self.states):
                self.touch(key)

    async def _worker(self, number: int) -> None:
        while True:
            key = await self.queue.get()
            self.metrics.queue.set(len(self.queue))
            started = time.perf_counter()
            try:
                outcome = await asyncio.to_thread(self.reconciler.reconcile, *key)
            except reconcile.ConflictError as err:
                log.info("%s: pass repeated", err)
                self.queue.add_after(key, 0.1)
            except kube.ApiException as err:
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
                log.exception(
                    "TrainingJob %s/%s: reconcile failed; retrying in %.1f s", *key, delay
                )
            else:
                self.queue.succeeded(key)
                if outcome.state is None:
                    self.forget(key)
                else:
                    self.states[key] = outcome.state
                    self._count()
                    if outcome.requeue_after is not None:
                        self.queue.add_after(key, outcome.requeue_after)
            finally:
                self.metrics.reconcile.observe(time.perf_counter() - started)
                self.queue.done(key)


# --- kopf wiring ---------------------------------------------------------------------------------


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's record of an object's last handled state, which only change handlers (`on.create`,
    `on.update`, ...) read; the operator has none, only `on.event`. kopf still builds the
    record of every event it processes (a deep copy of the whole body, then pruned): on a
    job's pods that was a tenth of kopf's time. Nothing is built, so nothing is compared."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return kopf.BodyEssence()

    def fetch(self, *, body: Any) -> Any:
        return None


def registry(controller: Controller) -> kopf.OperatorRegistry:
    """The kopf handlers, registered on their own registry (nothing happens at import time)."""
    reg = kopf.OperatorRegistry()
    options = controller.options

    @kopf.on.startup(registry=reg)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Own prefixes, so kopf's bookkeeping (if a change handler is ever added) stays ours.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
        settings.persistence.diffbase_storage = NoDiffBase(
            prefix=PREFIX, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{PREFIX}/finalizer"
        # kopf posts its own warnings and errors as Events; ours are posted by the passes.
        settings.posting.enabled = True
        settings.posting.level = logging.WARNING
        # Watches are re-opened every few minutes; a silent stream is noticed within a minute.
        settings.watching.server_timeout = 240
        settings.watching.client_timeout = 270
        settings.watching.connect_timeout = 10
        settings.watching.reconnect_backoff = 1.0
        settings.watching.inactivity_timeout = 60
        settings.networking.request_timeout = 60
        settings.networking.connect_timeout = 10
        if options.namespaces and not any("*" in ns for ns in options.namespaces):
            settings.scanning.disabled = True  # fixed namespaces: no namespace list needed
        controller.start()
        log.info(
            "jaxps operator: watching %s with %d workers",
            ", ".join(options.namespaces) or "every namespace",
            options.workers,
        )

    @kopf.on.login(registry=reg)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)  # the same credentials as kube.load_config()

    @kopf.on.cleanup(registry=reg)
    async def cleanup(**_: Any) -> None:
        await controller.stop()

    @kopf.on.event(kube.GROUP, kube.VERSION, kube.PLURAL, registry=reg)
    async def job_event(
        type: str, name: str, namespace: str | None, event: Mapping[str, Any], **_: Any
    ) -> None:
        if namespace is None:
            return
        if isinstance(controller.reconciler.cluster, kube.KubeCluster):
            controller.reconciler.cluster.seen(type, event.get("object") or {})
        if type == "DELETED":
            controller.forget((namespace, name))
        else:
            controller.touch((namespace, name))

    def child_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
        job = labels.get(builders.LABEL_JOB)
        if job and namespace is not None:
            controller.touch((namespace, job))

    for plural in ("pods", "services"):
        kopf.on.event(
            plural, labels={builders.LABEL_JOB: kopf.PRESENT}, id=f"{plural}-event", registry=reg
        )(child_event)
    if options.kueue:  # Kueue admits, evicts and requeues through the Workload: a pass each
        kopf.on.event(
            kueue.GROUP,
            kueue.VERSION,
            kueue_api.PLURAL,
            labels={builders.LABEL_JOB: kopf.PRESENT},
            id="workloads-event",
            registry=reg,
        )(child_event)

    @kopf.on.probe(id="jobs", registry=reg)
    def probe(**_: Any) -> dict[str, int]:
        return {"jobs": len(controller.states), "queued": len(controller.queue)}

    return reg


def identity() -> str:
    """This replica's name among peers: the pod's name (the chart's POD_ID), else host and pid.

    kopf would otherwise ask `getpass.getuser()`, which fails in an image that runs as a uid
    with no passwd entry (the operator image runs as 65532)."""
    return os.environ.get("POD_ID") or f"{socket.gethostname()}-{os.getpid()}"


def run(options: Options) -> None:
    """Runs the operator until SIGTERM or SIGINT."""
    kube.load_config()
    schema.compile_rules()  # now, not in the first job's pass
    metrics = Metrics()
    controller = Controller(
        options=options,
        reconciler=Reconciler(
            cluster=kube.KubeCluster(network_policies=options.network_policy),
            metrics=metrics,
            progress_interval=options.progress_interval,
            image=options.image,
            network_policy=options.network_policy,
            workloads=kueue_api.KubeWorkloads() if options.kueue else None,
        ),
        metrics=metrics,
    )
    if options.metrics_port is not None:
        start_http_server(options.metrics_port, registry=metrics.registry)
    kopf.configure(log_format=kopf.LogFormat.FULL, verbose=False)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # not a line per watch event
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # nor per kubelet probe
    kopf.run(
        registry=registry(controller),
        identity=identity(),  # type: ignore[arg-type]
        standalone=options.peering is None,
        peering_name=options.peering,
        priority=options.priority,
        liveness_endpoint=options.liveness,
        namespaces=options.namespaces,
        clusterwide=not options.namespaces,
    )
