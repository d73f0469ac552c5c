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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)
DEFAULT_PORT = 9090
LIVE_PATH = "/healthz"
READY_PATH = "/readyz"


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
        self.bytes_pushed = Counter(
            "jaxps_bytes_pushed", "Bytes of gradients pushed.", ["task"], registry=self.registry
        ).labels(**labels)
        self.bytes_pulled = Counter(
            "jaxps_bytes_pulled", "Bytes of parameters pulled.", ["task"], registry=self.registry
        ).labels(**labels)
        self.refused_updates = Counter(
            "jaxps_ps_refused_updates",
            "Updates a ps refused, by reason: nonfinite_gradient (a pushed gradient had a NaN "
            "or an inf), nonfinite_update (the optimizer's step made a parameter NaN or inf).",
            ["task", "reason"],
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

    def serve(self, port: int) -> int | None:
        """Serves /metrics, /healthz and /readyz on `port` (0: a free port) from a daemon
        thread; returns the port, or None if it failed."""
        try:
            server = make_server(
                "0.0.0.0", port, self._app(), ThreadingWSGIServer, handler_class=_Quiet
            )
        except OSError as err:
            log.warning("metrics: cannot listen on port %d (%s); metrics are off", port, err)
            return None
        self._server = server
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        bound = int(server.server_address[1])
        log.info(
            "metrics on http://0.0.0.0:%d/metrics, health on %s and %s",
            bound,
            LIVE_PATH,
            READY_PATH,
        )
        return bound

    def _app(self) -> Callable[..., Iterable[bytes]]:
        metrics = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path not in (LIVE_PATH, READY_PATH):
                return metrics(environ, start_response)  # type: ignore[no-any-return]
            ok = path == LIVE_PATH or self.ready.is_set()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8")],
            )
            return [b"ok\n" if ok else b"not serving\n"]

        return app

    def close(self) -> None:
        """Stops serving /metrics and frees the port (idempotent; within about 0.5 s, the
        server's poll interval)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class _Quiet(WSGIRequestHandler):
    """No access log: the kubelet probes every few seconds."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
