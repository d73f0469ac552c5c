"""Prometheus metrics every task serves on JAXPS_METRICS_PORT (DESIGN.md section 3), and the
task's health on the same plaintext HTTP port.

One registry per process (not prometheus_client's global one, so tests can build several).
The operator and `jaxps local` read the chief's `jaxps_global_step`, `jaxps_loss`, ... to fill
`status.progress`. Thread-safe (prometheus_client's metrics are).

Health is here, not on the gRPC port, because that port takes only clients with a certificate
of the job's CA (mutual TLS) and the kubelet has none: its gRPC probe speaks neither TLS nor
client certificates. `GET /healthz` answers 200 while the process runs (liveness); `GET
/readyz` answers 200 once the task serves its role (a ps's or the chief's gRPC server started,
a worker's configuration checked) and 503 before and once it stops (readiness). Neither says
more than that, and nothing on this port changes the task.

The port answers GET and HEAD of those three paths only (404 for another path, 405 for another
method) and reads no request body. It listens on the task's own address (`listen_host`: the
pod's IP, which the kubelet's probes, the operator and the API server's pod proxy reach), not
on every interface of the pod, and holds no client for long (`Limits`): a request line and
headers must come whole within a few seconds, and connections over a cap (in all, and per
client address) are closed at once, so that a peer holding half-sent requests neither starves
the kubelet's probes nor grows the task's threads without bound.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from jaxps_runtime.config import cluster

log = logging.getLogger(__name__)
DEFAULT_PORT = 9090
METRICS_PATH = "/metrics"
LIVE_PATH = "/healthz"
READY_PATH = "/readyz"
PATHS = (METRICS_PATH, LIVE_PATH, READY_PATH)
METHODS = ("GET", "HEAD")
ADDRESS_ENV = "JAXPS_METRICS_ADDRESS"  # where to listen (cluster.setting_problem checks it)
POD_IP_ENV = "JAXPS_POD_IP"  # the pod's IP, from the downward API (status.podIP)
_TEXT = ("Content-Type", "text/plain; charset=utf-8")
_PATHS_TEXT = ", ".join(PATHS)
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n"
)


@dataclass(frozen=True)
class Limits:
    """What one client may hold of a task's HTTP port. The kubelet, the operator and
    Prometheus send a whole request at once and hold a connection for milliseconds; the
    kubelet's probes give up after 5 s (builders.probes)."""

    request_seconds: float = 5.0
    """From the accept to the end of the headers (and again to take the answer)."""
    request_bytes: int = 16 * 1024
    """The request line and headers together."""
    connections: int = 64
    """Open at once, each with its thread; the next one is answered 503 and closed."""
    per_client: int = 8
    """Open at once from one client address: a peer that fills its share leaves the rest to
    the kubelet (the node's address), the operator and Prometheus."""


LIMITS = Limits()


class Unset:
    """A labelled gauge that is not served until its first `set`."""

    def __init__(self, family: Gauge, *, task: str) -> None:
        self._family, self._task = family, task

    def set(self, value: float) -> None:
        self._family.labels(task=self._task).set(value)


class Metrics:
    """The jaxps metrics of one task."""

    def __init__(self, *, task: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"task": task}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["task"], registry=self.registry).labels(**labels)

        self.global_step = gauge("jaxps_global_step", "The global step (the ps step).")
        # Absent until the first loss is known: an unset gauge reads 0.0, which the control
        # plane would show as the loss (a separate chief hears a loss only in heartbeats).
        self.loss = Unset(
            Gauge(
                "jaxps_loss",
                "The latest training loss (mean over workers).",
                ["task"],
                registry=self.registry,
            ),
            task=task,
        )
        self.examples_per_second = gauge(
            "jaxps_examples_per_second", "Training examples per second."
        )
        self.steps_per_second = gauge("jaxps_steps_per_second", "Global steps per second.")
        self.last_checkpoint_step = gauge(
            "jaxps_last_checkpoint_step", "The step of the last committed checkpoint."
        )
        self.training = gauge(
            "jaxps_training",
            "1 while the chief trains (the global step should move); 0 while it starts, "
            "restores, recovers or finishes.",
        )
        self.staleness = gauge(
            "jaxps_staleness", "Steps between a gradient's pull and its application."
        )
        # The data's shard queue (the chief's; a worker sets the epoch it reads from).
        self.data_epoch = gauge("jaxps_data_epoch", "The data epoch now (0 first).")
        self.data_shards = gauge(
            "jaxps_data_shards", "Shards of the data per epoch (0: a stream of unknown size)."
        )
        self.data_shards_done = gauge(
            "jaxps_data_shards_done", "Shards of this data epoch applied on every ps."
        )
        self.data_shards_leased = gauge("jaxps_data_shards_leased", "Shards leased to workers now.")
        self.data_leases_reclaimed = Counter(
            "jaxps_data_leases_reclaimed",
            "Leases taken back from workers that died, restarted or left without giving them back.",
            ["task"],
            registry=self.registry,
        ).labels(**labels)
        self.recoveries = Counter(
            "jaxps_recoveries",
            "Times the chief brought the ps tier back after a ps was lost (a rollback to the "
            "last checkpoint, or adopting the live ps).",
            ["task"],
            registry=self.registry,
        ).labels(**labels)
        self.recovered_to_step = gauge(
            "jaxps_recovered_to_step", "The global step the latest recovery went on from."
        )
        self.bytes_pushed = Counter(
            "jaxps_bytes_pushed", "Bytes of gradients pushed.", ["task"], registry=self.registry
        ).labels(**labels)
        self.bytes_pulled = Counter(
            "jaxps_bytes_pulled", "Bytes of parameters pulled.", ["task"], registry=self.registry
        ).labels(**labels)
        self.refused_updates = Counter(
            "jaxps_ps_refused_updates",
            "Updates a ps refused, by reason: nonfinite_gradient (a pushed gradient had a NaN "
            "or an inf), nonfinite_update (the optimizer's step made a parameter NaN or inf), "
            "invalid_request (a step, shard, shape, dtype or row no honest worker sends).",
            ["task", "reason"],
            registry=self.registry,
        )
        self.embedding = Gauge(
            "jaxps_ps_embedding",
            "A ps's part of each dynamic embedding table (training.embeddings), by what: "
            "resident (rows held now), capacity (the most it holds), and since the part was "
            "made (Init or Restore) admitted, evicted, lookups (ids read), hits (of those, "
            "resident) and dropped (gradients of ids not admitted).",
            ["task", "table", "what"],
            registry=self.registry,
        )
        self.embedding_hit_rate = Gauge(
            "jaxps_ps_embedding_hit_rate",
            "Of the ids a dynamic embedding table's part on a ps was asked for, the share "
            "resident (hits / lookups; 0 before any lookup).",
            ["task", "table"],
            registry=self.registry,
        )
        self._eval = Gauge(
            "jaxps_eval",
            "The latest evaluation metrics.",
            ["task", "metric"],
            registry=self.registry,
        )
        self._task = task
        self._server: Any = None
        self.ready = threading.Event()
        """Set once the task serves its role, cleared when it stops: `GET /readyz`."""

    def set_eval(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._eval.labels(task=self._task, metric=name).set(value)

    def serve(self, port: int, *, host: str | None = None, limits: Limits = LIMITS) -> int | None:
        """Serves /metrics, /healthz and /readyz on `host`:`port` (0: a free port) from a daemon
        thread; returns the port, or None if it failed (metrics and health are then off).

        `host` None: `listen_host(os.environ)`, the task's own address. "" or 0.0.0.0 or ::
        listen on all interfaces."""
        if host is None:
            host, why = listen_host(os.environ)
        else:
            why = "given"
        # the setting is checked here too: a value from `valueFrom` reaches no control plane
        problem = (
            cluster.setting_problem(ADDRESS_ENV, host, task_type="") if why == ADDRESS_ENV else None
        )
        if problem is not None:
            log.error("metrics: %s; metrics and health are off", problem)
            return None
        try:
            server = _Server(host=host, port=port, limits=limits)
        except OSError as err:
            log.warning("metrics: cannot listen on %s (%s); metrics are off", _url(host, port), err)
            return None
        server.set_app(self._app())
        self._server = server
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        bound = int(server.server_address[1])
        if not host:
            log.warning(
                "metrics: no address known for this task (%s, %s): listening on all interfaces",
                ADDRESS_ENV,
                POD_IP_ENV,
            )
        log.info(
            "metrics on %s/metrics (%s), health on %s and %s",
            _url(host, bound),
            why,
            LIVE_PATH,
            READY_PATH,
        )
        return bound

    def _app(self) -> Callable[..., Iterable[bytes]]:
        """The WSGI app: GET or HEAD of PATHS, 404 for any other path, 405 for any other
        method. Reads no request body, so no client can make it wait for one."""
        metrics = make_wsgi_app(self.registry)

        def answer(environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
            path = environ.get("PATH_INFO", "")
            if path not in PATHS:
                return "404 Not Found", [_TEXT], f"not found; paths: {_PATHS_TEXT}\n".encode()
            if environ.get("REQUEST_METHOD") not in METHODS:
                allow = ", ".join(METHODS)
                return "405 Method Not Allowed", [_TEXT, ("Allow", allow)], b"use GET\n"
            if path == METRICS_PATH:
                got: list[Any] = []
                body = b"".join(
                    metrics({**environ, "REQUEST_METHOD": "GET"}, lambda *a: got.extend(a[:2]))
                )
                return str(got[0]), list(got[1]), body
            if path == LIVE_PATH or self.ready.is_set():
                return "200 OK", [_TEXT], b"ok\n"
            return "503 Service Unavailable", [_TEXT], b"not serving\n"

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            status, headers, body = answer(environ)
            start_response(status, [*headers, ("Content-Length", str(len(body)))])
            return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]

        return app

    def close(self) -> None:
        """Stops serving /metrics and frees the port (idempotent; within about 0.5 s, the
        server's poll interval)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def listen_host(environ: Mapping[str, str]) -> tuple[str, str]:
    """Where a task's HTTP port listens, and why: JAXPS_METRICS_ADDRESS when set; else the
    pod's IP (JAXPS_POD_IP, the downward API's `status.podIP`), which the kubelet's probes, the
    operator and the API server's pod proxy reach; else the task's own address in TF_CONFIG
    when it is a loopback one (`jaxps local`); else "" (all interfaces: no address is known)."""
    explicit = environ.get(ADDRESS_ENV)
    if explicit is not None:
        return explicit, ADDRESS_ENV
    pod_ip = environ.get(POD_IP_ENV, "").strip()
    if pod_ip:
        return pod_ip, f"{POD_IP_ENV}, the pod's IP"
    try:
        config = cluster.from_env(environ)
    except cluster.ClusterSpecError:
        config = None
    if config is not None:
        own = config.cluster.address(config.task).rpartition(":")[0].strip("[]")
        if own == "localhost" or _loopback(own):
            return ("127.0.0.1" if own == "localhost" else own), "the task's loopback address"
    return "", "no address known"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(host: str, port: int) -> str:
    host = host or "0.0.0.0"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(ThreadingWSGIServer):
    """prometheus_client's threaded WSGI server, with `Limits`: at most `connections` at once
    and `per_client` from one address (a connection over either is answered 503 and closed at
    once, with no thread), each one request whose line and headers must come within
    `request_seconds` and `request_bytes`. Thread-safe: one thread accepts, one thread per
    connection answers, the counts are under a lock."""

    daemon_threads = True

    def __init__(self, *, host: str, port: int, limits: Limits) -> None:
        self.limits = limits
        self.request_queue_size = limits.connections
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}  # client address -> its connections open
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer's asks DNS for the host's name (socket.getfqdn), which can take seconds
        # before the pod's health answers: the host as given is all the WSGI environ needs.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()

    def _take(self, client: str) -> bool:
        with self._lock:
            mine = self._open.get(client, 0)
            if (
                mine >= self.limits.per_client
                or sum(self._open.values()) >= self.limits.connections
            ):
                return False
            self._open[client] = mine + 1
            return True

    def _give_back(self, client: str) -> None:
        with self._lock:
            left = self._open.pop(client) - 1
            if left:
                self._open[client] = left

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._take(str(client_address[0])):
            try:
                request.setblocking(False)
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_back(str(client_address[0]))
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_back(str(client_address[0]))

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that timed out, sent too much or hung up: dropped, not a traceback
        log.debug("metrics: dropped %s", client_address, exc_info=True)


class _Handler(WSGIRequestHandler):
    """One request per connection, read under the server's `Limits`; no access log (the
    kubelet probes every few seconds)."""

    server: _Server
    # A request line without a version (HTTP/0.9) is answered, or refused, with a status line.
    default_request_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        limits = self.server.limits
        self.connection.settimeout(limits.request_seconds)  # for writing the answer
        self.rfile.close()
        self.rfile = io.BufferedReader(_RequestReader(self.connection, limits=limits))

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _RequestReader(io.RawIOBase):
    """A connection's bytes until its deadline (`request_seconds` from the accept, however
    slowly they come: TimeoutError) and its `request_bytes` (http.client.LineTooLong, which
    BaseHTTPRequestHandler answers 431 within the headers). Not thread-safe: one connection's."""

    def __init__(self, sock: socket.socket, *, limits: Limits) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = time.monotonic() + limits.request_seconds
        self._left = limits.request_bytes
        self._write_timeout = limits.request_seconds

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request took too long")
        if self._left <= 0:
            raise http.client.LineTooLong("request line and headers")
        self._sock.settimeout(remaining)
        try:
            count = self._sock.recv_into(memoryview(buffer)[: self._left])
        finally:
            self._sock.settimeout(self._write_timeout)
        self._left -= count
        return count
