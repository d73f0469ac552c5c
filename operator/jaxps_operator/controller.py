"""The operator: kopf watches, a work queue, and passes that carry the planner's Plans out.

    jaxps operator [--namespace NS ...]

kopf delivers the watch events of TrainingJobs and of the pods and Services labelled with
`jaxps.dev/job-name`; each only puts the job's key on a work queue (stateless `on.event`
handlers: kopf writes nothing on any object). Workers take a key at a time, never the same
key twice at once, and run one level-based pass in a thread, so blocking API calls never stall
the event loop:

    GET the job -> LIST its pods -> GET its Service -> planner.plan(...) -> delete, create
    -> read the chief's metrics (status.progress) -> one status write, only if it changed
    -> Events -> delete the job when its TTL is over

Events that arrive during a pass queue the key again; a Plan's `requeue_after` (deadline, TTL)
and the progress interval are real timers. The status is written with the resourceVersion that
was read, so a concurrent change (409) just repeats the pass. Pods are created with deterministic
names, so a create that answers 409 is success and a restarted operator creates no duplicates.
"""

from __future__ import annotations

import asyncio
import copy
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

from jaxps_operator import kube, planner, progress, schema

PREFIX = "jaxps.dev"
CHILD_CALLS = 8  # creates or deletes of one pass in flight at once
STATES = ("Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
Key = tuple[str, str]  # (namespace, name)
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
    image: str = planner.DEFAULT_IMAGE  # the runtime image of pods whose template names none


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


def pod_state(pod: Mapping[str, Any], owner_uid: str) -> planner.PodState | None:
    """What the planner needs of a pod; pods of another job with the same name count as leaving."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    try:
        role, index = labels[planner.LABEL_ROLE], int(labels[planner.LABEL_INDEX])
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    owned = any(ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or [])
    main = ((pod.get("spec") or {}).get("containers") or [{}])[0].get("name")
    terminated: Mapping[str, Any] = {}
    for container in status.get("containerStatuses") or []:
        state = (container.get("state") or {}).get("terminated")
        if state and (container.get("name") == main or not terminated):
            terminated = state
    return planner.PodState(
        name=meta["name"],
        role=role,
        index=index,
        phase=status.get("phase", "Pending"),
        ready=any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        ),
        exit_code=terminated.get("exitCode"),
        reason=status.get("reason") or terminated.get("reason") or "",
        deleting=bool(meta.get("deletionTimestamp")) or not owned,
    )


@dataclass
class Outcome:
    state: str | None  # None: the job is gone
    requeue_after: float | None = None


@dataclass
class Reconciler:
    api: kube.Api
    metrics: Metrics
    progress_interval: float = 10.0
    image: str = planner.DEFAULT_IMAGE
    invalid: set[str] = field(default_factory=set)  # uids already reported as invalid
    validated: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(CHILD_CALLS, thread_name_prefix="jaxps-child")
    )

    def reconcile(self, namespace: str, name: str) -> Outcome:
        # the three reads at once: the job, its pods, its Service
        pods_read = self.pool.submit(self.api.list_pods, namespace, f"{planner.LABEL_JOB}={name}")
        service_read = self.pool.submit(self.api.service_exists, namespace, name)
        raw = self.api.get_job(namespace, name)
        pods, service_exists = pods_read.result(), service_read.result()
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return Outcome(state=None)
        meta = raw["metadata"]
        try:
            job = self._spec(raw)
        except schema.InvalidManifestError as err:
            # the API server enforces the same schema, so this is a CRD older than the operator
            if meta["uid"] not in self.invalid:
                self.invalid.add(meta["uid"])
                self.api.post_event(raw, type_="Warning", reason="InvalidSpec", message=str(err))
            return Outcome(state=(raw.get("status") or {}).get("state", "Created"))
        job["metadata"] = meta
        job["status"] = raw.get("status") or {}
        observed = [s for p in pods if (s := pod_state(p, meta["uid"])) is not None]
        plan = planner.plan(
            job, observed, datetime.now(UTC), service_exists=service_exists, image=self.image
        )
        # deletes, then creates, each batch in parallel (a job's pods appear together)
        gone = list(self.pool.map(lambda n: self.api.delete_pod(namespace, n), plan.delete))
        deleted = [n for n, ok in zip(plan.delete, gone, strict=True) if ok]
        made = list(self.pool.map(lambda m: self.api.create(namespace, m), plan.create))
        created = [
            f"{m['kind']} {m['metadata']['name']}"
            for m, ok in zip(plan.create, made, strict=True)
            if ok
        ]
        status = plan.status
        chief = self._chief(job, pods)
        if chief is not None:
            status["progress"] = self._progress(chief, status.get("progress") or {})
        if status != job["status"]:
            self.api.replace_job_status({**raw, "status": status})
        if deleted:
            plan.events.append(
                planner.Event("Normal", "PodsDeleted", f"deleted pod {', '.join(deleted)}")
            )
        if created:
            plan.events.append(planner.Event("Normal", "Created", f"created {', '.join(created)}"))
        for event in plan.events:
            self.api.post_event(raw, type_=event.type, reason=event.reason, message=event.message)
            if event.reason == "PodReplaced":
                self.metrics.replacements.labels(role=event.message.split(" ", 1)[0]).inc()
        if plan.delete_job:
            log.info("TrainingJob %s/%s: ttlSecondsAfterFinished is over: deleted", namespace, name)
            self.api.delete_job(namespace, name)
            return Outcome(state=None)
        requeue = plan.requeue_after
        if chief is not None and status["state"] not in planner.TERMINAL:
            requeue = min(requeue or self.progress_interval, self.progress_interval)
        return Outcome(state=status["state"], requeue_after=requeue)

    def _spec(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """The job validated with defaults applied, once per uid and generation (CEL is slow)."""
        key = (raw["metadata"]["uid"], raw["metadata"].get("generation", 0))
        if key not in self.validated:
            self.validated = {
                k: v for k, v in self.validated.items() if k[0] != key[0]
            }  # one generation per job
            self.validated[key] = schema.validate({k: v for k, v in raw.items() if k != "status"})
        return copy.deepcopy(self.validated[key])

    @staticmethod
    def _chief(job: Mapping[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The chief's pod while it runs with an IP, or once it has succeeded."""
        name = planner.pod_name(job, *planner.chief_task(job))
        for p in pods:
            status = p.get("status") or {}
            if p["metadata"]["name"] != name:
                continue
            if status.get("phase") == "Succeeded" or (
                status.get("phase") == "Running"
                and status.get("podIP")
                and not p["metadata"].get("deletionTimestamp")
            ):
                return p
        return None

    @staticmethod
    def _progress(chief: Mapping[str, Any], previous: Mapping[str, Any]) -> dict[str, Any]:
        """The chief's final summary (its termination message) once it ended, else its metrics."""
        status = chief.get("status") or {}
        for container in status.get("containerStatuses") or []:
            ended = (container.get("state") or {}).get("terminated") or {}
            done = progress.summary(ended.get("message"))
            if done is not None:
                return progress.final(previous, done)
        if status.get("phase") != "Running":
            return dict(previous)
        port = planner.metrics_port(chief["spec"]["containers"][0])
        return progress.merge(previous, progress.read_metrics(chief["status"]["podIP"], port))


# --- the work queue (event loop) -----------------------------------------------------------------


class WorkQueue:
    """Keys to reconcile: deduplicated, one pass per key at a time, delayed adds as timers."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._pending: set[Key] = set()
        self._active: set[Key] = set()
        self._again: set[Key] = set()
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, key: Key) -> None:
        if key in self._active:
            self._again.add(key)
        elif key not in self._pending:
            self._pending.add(key)
            self._queue.put_nowait(key)

    def add_after(self, key: Key, delay: float) -> None:
        """Adds `key` in `delay` seconds, unless an earlier timer is already set."""
        loop = asyncio.get_running_loop()
        due = loop.time() + max(delay, 0.0)
        current = self._timers.get(key)
        if current is not None and current[0] <= due and not current[1].cancelled():
            return
        if current is not None:
            current[1].cancel()

        def fire() -> None:
            self._timers.pop(key, None)
            self.add(key)

        self._timers[key] = (due, loop.call_at(due, fire))

    def forget(self, key: Key) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()

    async def get(self) -> Key:
        key = await self._queue.get()
        self._pending.discard(key)
        self._active.add(key)
        return key

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key)

    def tracked(self) -> set[Key]:
        """Every key queued, in a pass, or waiting on a timer."""
        return set(self._timers) | self._pending | self._active


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
            except kube.ConflictError as err:
                log.info("%s: pass repeated", err)
                self.queue.add_after(key, 0.1)
            except kube.ApiException as err:
                self.metrics.errors.inc()
                log.warning(
                    "TrainingJob %s/%s: the API answered %s: %s; retrying in 5 s",
                    *key,
                    err.status,
                    kube.message(err),
                )
                self.queue.add_after(key, 5.0)
            except Exception:
                self.metrics.errors.inc()
                log.exception("TrainingJob %s/%s: reconcile failed; retrying in 5 s", *key)
                self.queue.add_after(key, 5.0)
            else:
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


def registry(controller: Controller) -> kopf.OperatorRegistry:
    """The kopf handlers, registered on their own registry (nothing happens at import time)."""
    reg = kopf.OperatorRegistry()
    options = controller.options

    @kopf.on.startup(registry=reg)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Own prefixes, so kopf's bookkeeping (if a change handler is ever added) stays ours.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
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
    async def job_event(type: str, name: str, namespace: str | None, **_: Any) -> None:
        if namespace is None:
            return
        if type == "DELETED":
            controller.forget((namespace, name))
        else:
            controller.touch((namespace, name))

    def child_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
        job = labels.get(planner.LABEL_JOB)
        if job and namespace is not None:
            controller.touch((namespace, job))

    for plural in ("pods", "services"):
        kopf.on.event(
            plural, labels={planner.LABEL_JOB: kopf.PRESENT}, id=f"{plural}-event", registry=reg
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
    metrics = Metrics()
    controller = Controller(
        options=options,
        reconciler=Reconciler(
            api=kube.Api(),
            metrics=metrics,
            progress_interval=options.progress_interval,
            image=options.image,
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
