"""What a ps holds of one shard (`Held`), the counters it reports (`Counters`) and the names of
its states (`STATE_NAMES`): the pieces of its state that the store, its parts and its modes all
name."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.wire import streams
from jaxps_runtime.wire.streams import Spec

_SPARE_BUFFERS = 2
STATE_NAMES = {v: k for k, v in ps_pb2.PsState.items()}  # for messages: "READY", ...


@dataclass
class Held:
    """One shard: its spec, current value and optimizer state (None until assigned).

    `spare` holds gradient staging buffers of finished pushes for the next ones to reuse:
    fresh memory costs a page fault per 4 KiB, more than receiving the bytes into it.
    """

    spec: Spec
    value: jax.Array | np.ndarray | None = None  # np.ndarray: updated in place by rows
    # How pushes update it, as the chief declared at Init: True, by rows (an embedding table's
    # shard); False, whole; None, not declared (a chief that declares no table: either way).
    by_rows: bool | None = None
    opt_state: Any = None
    spare: list[np.ndarray] = field(default_factory=list)
    # A dynamic embedding table's part (`dynamic.Table`): rows keyed by id, its values and
    # state its own; `value` is then its row storage, never assigned or read whole.
    dynamic: Any = None

    def staging(self) -> np.ndarray:
        try:
            return self.spare.pop()  # list.pop is atomic under the GIL
        except IndexError:
            return streams.empty(self.spec.shape, self.spec.dtype)

    def recycle(self, buffer: np.ndarray) -> None:
        if (
            len(self.spare) < _SPARE_BUFFERS
            and buffer.flags.writeable
            and buffer.shape == self.spec.shape
            and streams.aligned(buffer)
        ):
            self.spare.append(buffer)


@dataclass
class Counters:
    """Monotonic counters reported by Status (and, later, as Prometheus metrics)."""

    values: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, amount: float = 1.0) -> None:
        with self.lock:
            self.values[name] = self.values.get(name, 0.0) + amount

    def refused(self, reason: str) -> None:
        """Counts one update refused for `reason` (one of `terms.REFUSALS`)."""
        self.add(f"refused_{reason}")

    def set(self, name: str, value: float) -> None:
        with self.lock:
            self.values[name] = value

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return dict(self.values)
