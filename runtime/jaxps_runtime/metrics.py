"""Prometheus metrics every task serves on JAXPS_METRICS_PORT (DESIGN.md section 3).

One registry per process (not prometheus_client's global one, so tests can build several).
The operator and `jaxps local` read the chief's `jaxps_global_step`, `jaxps_loss`, ... to fill
`status.progress`. Thread-safe (prometheus_client's metrics are).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

log = logging.getLogger(__name__)
DEFAULT_PORT = 9090


class Metrics:
    """The jaxps metrics of one task."""

    def __init__(self, *, task: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"task": task}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["task"], registry=self.registry).labels(**labels)

        self.global_step = gauge("jaxps_global_step", "The global step (the ps step).")
        self.loss = gauge("jaxps_loss", "The latest training loss (mean over workers).")
        self.examples_per_second = gauge(
            "jaxps_examples_per_second", "Training examples per second."
        )
        self.steps_per_second = gauge("jaxps_steps_per_second", "Global steps per second.")
        self.last_checkpoint_step = gauge(
            "jaxps_last_checkpoint_step", "The step of the last committed checkpoint."
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
        self._eval = Gauge(
            "jaxps_eval",
            "The latest evaluation metrics.",
            ["task", "metric"],
            registry=self.registry,
        )
        self._task = task
        self._server: Any = None

    def set_eval(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._eval.labels(task=self._task, metric=name).set(value)

    def serve(self, port: int) -> int | None:
        """Serves /metrics on `port` (0: a free port); returns the port, or None if it failed."""
        try:
            server, _ = start_http_server(port, registry=self.registry)
        except OSError as err:
            log.warning("metrics: cannot listen on port %d (%s); metrics are off", port, err)
            return None
        self._server = server
        bound = int(server.server_address[1])
        log.info("metrics on http://0.0.0.0:%d/metrics", bound)
        return bound

    def close(self) -> None:
        """Stops serving /metrics and frees the port (idempotent; within about 0.5 s, the
        server's poll interval)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
