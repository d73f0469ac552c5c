"""Running a ps task: the gRPC server, the health service, signals and a clean exit.

A restarted ps is on the critical path of recovery (nothing trains until it is back), and most
of its start is importing JAX. So the server listens first, with gRPC loaded but no JAX, and
loads the parameter store (and JAX) behind it (`PsServer.load`): its peers' channels reconnect
while it loads, and every call that arrives meanwhile waits for the store, then runs
(`Loading`). Listening only once loaded, a ps got the chief's first call 0.3-0.5 s after it
could have (the channel's reconnect backoff; bench/recovery.py on 2 cores); now ~10 ms after.
The health service says SERVING, and /readyz 200, once the store is loaded.

`serve_ps` blocks until the Shutdown RPC or the task's stop (SIGTERM or SIGINT, see `stopping`),
then stops accepting calls, wakes the pulls waiting for a step, lets the calls in flight finish
(a few seconds at most), and returns 0 so the pod or process ends Succeeded: a ps never lingers
after its job (research pitfall 1).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxps_runtime.config import cluster
from jaxps_runtime.process import stopping, xla
from jaxps_runtime.wire import bulk, rpc
from jaxps_runtime.wire.credentials import TaskCredentials

if TYPE_CHECKING:
    from jaxps_runtime.process.metrics import Metrics
    from jaxps_runtime.ps.store import ParameterStore

log = logging.getLogger(__name__)

GRACE_SECONDS = 5.0
# Each stream in flight pins a thread: pushes and long-polling pulls from every worker at once.
MAX_THREADS = 64
HEALTH_SERVICES = ("", rpc.PARAMETER_SERVER.full_name)
# The longest a call waits for the store to load (seconds), when its deadline is later or none.
MAX_LOAD_WAIT_SECONDS = 60.0


class BindError(RuntimeError):
    """The server could not listen on its address."""


def bind_address(address: str, *, override: str | None = None) -> str:
    """Where to listen: `override`, else loopback for a loopback address, else all interfaces."""
    if override:
        return override
    host, _, port = address.rpartition(":")
    if host in ("127.0.0.1", "localhost", "[::1]"):
        return f"{host}:{port}"
    return f"[::]:{port}"


class Loading:
    """Stands in for the ParameterServicer from the moment the server listens: each method
    waits until the servicer is given (`serve`), then runs the servicer's method of the same
    name; a call that cannot wait any longer (its deadline passed, or the server stopped before
    it was given) ends UNAVAILABLE, which callers retry. Once given, calls go straight to it.
    Thread-safe: one instance serves every call of a server."""

    def __init__(self, task: str, *, methods: Collection[str]) -> None:
        self._task = task
        self._methods = frozenset(methods)  # the servicer's methods it stands in for
        self._servicer: Any = None
        self._stopping = False
        self._settled = threading.Event()  # served, or stopping: no call waits any longer

    def serve(self, servicer: Any) -> None:
        self._servicer = servicer
        self._settled.set()

    def stop(self) -> None:
        self._stopping = True
        self._settled.set()

    def servicer(self, context: grpc.ServicerContext) -> Any:
        """The servicer, once given; or the call ends (`context.abort`)."""
        # A call without a deadline has "infinite" time left, beyond what a wait can take.
        self._settled.wait(timeout=min(context.time_remaining(), MAX_LOAD_WAIT_SECONDS))
        if self._servicer is None:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{self._task} is stopping" if self._stopping else f"{self._task} is starting",
            )
        return self._servicer

    def __getattr__(self, name: str) -> Callable[[Any, grpc.ServicerContext], Any]:
        if name not in self._methods:
            raise AttributeError(name)

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            return getattr(self.servicer(context), name)(request, context)

        call.__name__ = name
        return call


class PsServer:
    """One ps task's server: `start` listens, `load` brings the store up behind it (calls in
    between wait for it), `wait` returns once it is told to stop and has stopped."""

    def __init__(
        self,
        *,
        address: str,
        job_id: str,
        task: str,
        bind: str | None = None,
        credentials: TaskCredentials | None = None,
        chief: tuple[str, int] = ("chief", 0),
    ) -> None:
        self.job_id = job_id
        self.task = task
        self.store: ParameterStore | None = None  # once loaded
        self._loading = Loading(task, methods=rpc.PARAMETER_SERVER.methods)
        self._stop = threading.Event()
        self.reason = ""
        self._server = grpc.server(
            futures.ThreadPoolExecutor(MAX_THREADS, thread_name_prefix=f"{task}-rpc"),
            options=list(rpc.SERVER_OPTIONS),
        )
        guard = None if credentials is None else rpc.Guard(job=job_id, chief=chief)
        self._server.add_generic_rpc_handlers(
            (rpc.PARAMETER_SERVER.generic_handler(self._loading, guard=guard),)
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        where = bind_address(address, override=bind)
        self._where, self._credentials, self._chief = where, credentials, chief
        self.bulk: bulk.BulkServer | None = None  # once loaded
        try:
            self.port = rpc.add_port(self._server, where, credentials)
        except RuntimeError as err:
            raise BindError(f"{task}: cannot listen on {where}: {err}") from err
        if not self.port:
            raise BindError(f"{task}: cannot listen on {where} (address in use?)")

    def start(self) -> None:
        """Listens; calls wait until `load` is done."""
        for service in HEALTH_SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server.start()
        log.info("%s: listening on port %d, loading the parameter store", self.task, self.port)

    def load(self) -> None:
        """Imports the store (JAX: most of a ps's start) and serves it."""
        started = time.monotonic()
        from jaxps_runtime.ps.servicer import ParameterServicer  # noqa: PLC0415
        from jaxps_runtime.ps.store import ParameterStore  # noqa: PLC0415

        # before any update compiles; a ps's count is always set (1 by default)
        xla.start_cpu_backend(cluster.xla_threads(os.environ, task_type=cluster.PS) or 1)
        self.store = store = ParameterStore(job_id=self.job_id, task=self.task)
        servicer = ParameterServicer(store, on_shutdown=self.stop)
        if cluster.bulk_on(os.environ):
            try:
                self.bulk = bulk.BulkServer(
                    servicer,
                    host=bulk.split_host(self._where),
                    task=self.task,
                    job=self.job_id,
                    chief=self._chief,
                    credentials=self._credentials,
                    on_call=lambda: store.counters.add("bulk_calls"),
                    placed=store.shards.specs,
                )
            except OSError as err:  # gRPC alone still serves every call
                log.warning(
                    "%s: cannot open the bulk path (%s); calls go over gRPC", self.task, err
                )
            else:
                self.bulk.start()
                servicer.bulk_port = self.bulk.port
        self._loading.serve(servicer)
        for service in HEALTH_SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "%s: serving %s on port %d, its bulk path %s (loaded in %.2f s)",
            self.task,
            rpc.PARAMETER_SERVER.full_name,
            self.port,
            f"on port {self.bulk.port}" if self.bulk else "off (JAXPS_BULK)",
            time.monotonic() - started,
        )

    def stop(self, reason: str) -> None:
        """Asks the server to stop; safe from any thread and from signal handlers."""
        if not self._stop.is_set():
            self.reason = reason
            self._stop.set()
            self._loading.stop()

    @property
    def stopped(self) -> threading.Event:
        return self._stop

    def wait(self) -> None:
        # In slices, not one wait: a signal's Python handler runs only when the main thread
        # runs, and a SIGTERM the kernel gives another thread (one of XLA's) wakes no lock wait
        # of the main one (a standby's ps was SIGKILLed 15 s after a SIGTERM it never saw).
        while not self._stop.wait(timeout=0.5):
            pass
        store = self.store
        step = store.step if store is not None else 0
        log.info("%s: stopping (%s) at step %d", self.task, self.reason, step)
        self.health.enter_graceful_shutdown()
        if store is not None:
            store.shutdown()
        if self.bulk is not None:
            self.bulk.close()
        self._server.stop(GRACE_SECONDS).wait()
        if store is not None:
            store.close()


def run(
    *,
    spec: cluster.TFConfig,
    job_id: str,
    stop: stopping.Stop,
    bind: str | None = None,
    metrics_port: int = 0,
    credentials: TaskCredentials | None = None,
) -> int:
    """`serve_ps` for the ps task of `spec` (its address, and its chief's role and index)."""
    task, chief = spec.task, spec.cluster.chief_task()
    return serve_ps(
        address=spec.cluster.address(task),
        job_id=job_id,
        task=task.name,
        stop=stop,
        bind=bind,
        metrics_port=metrics_port,
        credentials=credentials,
        chief=(chief.type, chief.index),
    )


def serve_ps(
    *,
    address: str,
    job_id: str,
    task: str,
    stop: stopping.Stop,
    bind: str | None = None,
    metrics_port: int = 0,
    credentials: TaskCredentials | None = None,
    chief: tuple[str, int] = ("chief", 0),
) -> int:
    """Serves until the Shutdown RPC or `stop`; returns the process exit code: 0 after Shutdown
    (training is over), 128 + the signal after a stop (143 for SIGTERM): a ps stopped mid-job did
    not finish, so Kubernetes must not see a Succeeded pod that the operator would never replace
    (a node drain, an eviction)."""
    try:
        server = PsServer(
            address=address,
            job_id=job_id,
            task=task,
            bind=bind,
            credentials=credentials,
            chief=chief,
        )
    except BindError as err:
        log.error("%s", err)
        return 1
    server.start()
    # after start: a stop that came during start-up stops the running server (a stop before
    # start would be undone by it and the ps would serve until SIGKILL)
    unregister = stop.callback(lambda: server.stop(stop.reason))
    # Imported once listening, as the store is: nothing a restarted ps's peers wait for.
    from jaxps_runtime.process.metrics import Metrics  # noqa: PLC0415

    metrics = Metrics(task=task)
    serving_metrics = bool(metrics_port) and metrics.serve(metrics_port) is not None
    try:
        if not server.stopped.is_set():
            try:
                server.load()
            except BaseException:
                server.stop("the parameter store failed to load")
                server.wait()
                raise
            if serving_metrics:
                _refresh_metrics(server, metrics)
            metrics.ready.set()  # /readyz: cleared by _refresh_metrics once the server stops
        server.wait()
    finally:
        unregister()
        metrics.close()
    return stop.exit_code if stop.is_set else 0


def _refresh_metrics(server: PsServer, metrics: Metrics) -> None:
    """The ps's metrics: its step and bytes moved, refreshed every second from its counters;
    not ready once the server is told to stop (a signal or the Shutdown RPC)."""
    from jaxps_runtime.wire import terms  # noqa: PLC0415

    store = server.store
    assert store is not None, "the store is loaded first"
    refused = {
        f"refused_{reason}": metrics.refused_updates.labels(task=server.task, reason=reason)
        for reason in terms.REFUSALS
    }  # labelled now, so that each reads 0 until its first refusal
    seen = dict.fromkeys(["bytes_in", "bytes_out", *refused], 0.0)

    def refresh() -> None:
        while not server.stopped.wait(1.0):
            counters = store.counters.snapshot()
            metrics.global_step.set(store.step)
            metrics.staleness.set(counters.get("staleness", 0.0))
            for key, counter in (
                ("bytes_in", metrics.bytes_pushed),
                ("bytes_out", metrics.bytes_pulled),
                *refused.items(),
            ):
                counter.inc(counters.get(key, 0.0) - seen[key])
                seen[key] = counters.get(key, 0.0)
            for table, part in store.shards.table_counters().items():
                for what, value in part.items():
                    metrics.embedding.labels(task=server.task, table=table, what=what).set(value)
                lookups = part["lookups"]
                rate = part["hits"] / lookups if lookups else 0.0
                metrics.embedding_hit_rate.labels(task=server.task, table=table).set(rate)
        metrics.ready.clear()

    threading.Thread(target=refresh, name="metrics", daemon=True).start()
