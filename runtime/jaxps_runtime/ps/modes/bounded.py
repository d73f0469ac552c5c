"""Bounded staleness (stale synchronous parallel): async, but a worker's read waits while it is
more than `Mode.max_staleness` pushes ahead of the slowest live worker."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.ps.modes.asynchronous import Async
from jaxps_runtime.ps.modes.policy import PsError, Store
from jaxps_runtime.wire.terms import Mode


class Bounded(Async):
    def __init__(self, store: Store, mode: Mode, workers: Sequence[str]) -> None:
        super().__init__(store, mode, workers)
        self._clocks: dict[str, int] = {}  # pushes counted per worker; under store.lock

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

    def before_read(self, worker: str, *, is_active: Callable[[], bool]) -> None:
        store = self.store
        with store.changed:
            while worker in self.workers:
                slowest = min(self._clocks.get(w, 0) for w in self.workers)
                if self._clocks.get(worker, 0) - slowest <= self.mode.max_staleness:
                    return
                if store.state == ps_pb2.SHUTTING_DOWN:
                    raise PsError(grpc.StatusCode.UNAVAILABLE, f"{store.task} is shutting down")
                if not is_active():
                    raise PsError(grpc.StatusCode.CANCELLED, "the caller went away")
                store.changed.wait(timeout=0.5)
