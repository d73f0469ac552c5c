"""Running a ps task: the gRPC server, the health service, signals and a clean exit.

`serve_ps` blocks until the Shutdown RPC or the task's stop (SIGTERM or SIGINT, see `stopping`),
then stops accepting calls, wakes the pulls waiting for a step, lets the calls in flight finish
(a few seconds at most), and returns 0 so the pod or process ends Succeeded: a ps never lingers
after its job (research pitfall 1).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxps_runtime import rpc, stopping
from jaxps_runtime.credentials import TaskCredentials
from jaxps_runtime.metrics import Metrics
from jaxps_runtime.ps import ParameterServicer
from jaxps_runtime.shards import ParameterStore

log = logging.getLogger(__name__)

GRACE_SECONDS = 5.0
# Each stream in flight pins a thread: pushes and long-polling pulls from every worker at once.
MAX_THREADS = 64


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


class PsServer:
    """One ps task's server; `wait` returns once it is told to stop and has stopped."""

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
        self.store = ParameterStore(job_id=job_id, task=task)
        self._stop = threading.Event()
        self.reason = ""
        self._server = grpc.server(
            futures.ThreadPoolExecutor(MAX_THREADS, thread_name_prefix=f"{task}-rpc"),
            options=list(rpc.SERVER_OPTIONS),
        )
        servicer = ParameterServicer(self.store, on_shutdown=self.stop)
        guard = None if credentials is None else rpc.Guard(job=job_id, chief=chief)
        self._server.add_generic_rpc_handlers(
            (rpc.PARAMETER_SERVER.generic_handler(servicer, guard=guard),)
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        where = bind_address(address, override=bind)
        try:
            self.port = rpc.add_port(self._server, where, credentials)
        except RuntimeError as err:
            raise BindError(f"{task}: cannot listen on {where}: {err}") from err
        if not self.port:
            raise BindError(f"{task}: cannot listen on {where} (address in use?)")
        self.task = task

    def start(self) -> None:
        self._server.start()
        for service in ("", rpc.PARAMETER_SERVER.full_name):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s: serving %s on port %d", self.task, rpc.PARAMETER_SERVER.full_name, self.port)

    def stop(self, reason: str) -> None:
        """Asks the server to stop; safe from any thread and from signal handlers."""
        if not self._stop.is_set():
            self.reason = reason
            self._stop.set()

    @property
    def stopped(self) -> threading.Event:
        return self._stop

    def wait(self) -> None:
        self._stop.wait()
        log.info("%s: stopping (%s) at step %d", self.task, self.reason, self.store.step)
        self.health.enter_graceful_shutdown()
        self.store.shutdown()
        self._server.stop(GRACE_SECONDS).wait()
        self.store.close()


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
    metrics = Metrics(task=task)
    if metrics_port and metrics.serve(metrics_port) is not None:
        _refresh_metrics(server, metrics)
    server.start()
    metrics.ready.set()  # /readyz: cleared by _refresh_metrics once the server stops
    # after start: a stop that came during start-up stops the running server (a stop before
    # start would be undone by it and the ps would serve until SIGKILL)
    unregister = stop.callback(lambda: server.stop(stop.reason))
    try:
        server.wait()
    finally:
        unregister()
        metrics.close()
    return stop.exit_code if stop.is_set else 0


def _refresh_metrics(server: PsServer, metrics: Metrics) -> None:
    """The ps's metrics: its step and bytes moved, refreshed every second from its counters;
    not ready once the server is told to stop (a signal or the Shutdown RPC)."""
    seen = {"bytes_in": 0.0, "bytes_out": 0.0}

    def refresh() -> None:
        while not server.stopped.wait(1.0):
            counters = server.store.counters.snapshot()
            metrics.global_step.set(server.store.step)
            metrics.staleness.set(counters.get("staleness", 0.0))
            for key, counter in (
                ("bytes_in", metrics.bytes_pushed),
                ("bytes_out", metrics.bytes_pulled),
            ):
                counter.inc(counters.get(key, 0.0) - seen[key])
                seen[key] = counters.get(key, 0.0)
        metrics.ready.clear()

    threading.Thread(target=refresh, name="metrics", daemon=True).start()
