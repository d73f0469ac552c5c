"""Bounded staleness (stale synchronous parallel): async, but a worker's read waits while it is
more than `Mode.max_staleness` pushes ahead of the slowest live worker.

Each ps counts the pushes on its own, so its clocks can differ from another ps's by the pushes
one counted and the other did not (a step's last slot taken by another worker's push on one ps,
an idle word that met different pushes on each). So a hold is never what ends training:
- once the ps reached the last step no push counts any more, and nobody is held;
- a read held `STALLED_SECONDS` while no push counted here is let through: the worker it waits
  for pushes nothing (held itself on another ps, or hung without leaving: the chief drops a
  dead one), and waiting longer would only stall the job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.ps.modes.asynchronous import Async
from jaxps_runtime.ps.modes.policy import PsError, Store
from jaxps_runtime.wire.terms import Mode

STALLED_SECONDS = 10.0


class Bounded(Async):
    def __init__(self, store: Store, mode: Mode, workers: Sequence[str]) -> None:
        super().__init__(store, mode, workers)
        self._clocks: dict[str, int] = {}  # pushes counted per worker; under store.lock
        self._moved = time.monotonic()  # when a push last counted here

    def set_workers(self, workers: Sequence[str]) -> None:
        """A worker that joins starts level with the slowest live one: nobody waits for it to
        catch up on pushes made before it came."""
        with self.store.changed:
            known = [self._clocks.get(w, 0) for w in self.workers if w in workers]
            start = min(known) if known else 0
            for worker in workers:
                if worker not in self.workers:
                    self._clocks[worker] = max(self._clocks.get(worker, 0), start)
        super().set_workers(workers)

    def idle(self, worker: str) -> None:
        """A worker with no data holds nobody back: it counts as level with the fastest."""
        if worker:
            live = [self._clocks.get(w, 0) for w in self.workers]
            self._clocks[worker] = max([*live, self._clocks.get(worker, 0)])

    def counted(self, worker: str) -> None:
        if worker:
            self._clocks[worker] = self._clocks.get(worker, 0) + 1
            self._moved = time.monotonic()

    def before_read(self, worker: str, *, is_active: Callable[[], bool]) -> None:
        store = self.store
        with store.changed:
            while worker in self.workers:
                slowest = min(self._clocks.get(w, 0) for w in self.workers)
                if self._clocks.get(worker, 0) - slowest <= self.mode.max_staleness:
                    return
                if self.mode.last_step and store.step >= self.mode.last_step:
                    return  # training is over here: nobody pushes to catch up
                if time.monotonic() - self._moved >= STALLED_SECONDS:
                    store.counters.add("holds_let_through")
                    return
                if store.state == ps_pb2.SHUTTING_DOWN:
                    raise PsError(grpc.StatusCode.UNAVAILABLE, f"{store.task} is shutting down")
                if not is_active():
                    raise PsError(grpc.StatusCode.CANCELLED, "the caller went away")
                store.changed.wait(timeout=0.5)
