"""A ps's checkpoints (`Checkpointing`, a part of `store.ParameterStore`): the snapshot a Save
asks for, exact at its step in every mode, and a Restore of every declared shard, its optimizer
state and every dynamic table's part. The state they read and set is the store's, under its
lock, as its module's contract says (`store`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.ps import snapshots
from jaxps_runtime.ps.held import STATE_NAMES
from jaxps_runtime.ps.modes.policy import Policy, PsError
from jaxps_runtime.ps.positions import Positions
from jaxps_runtime.ps.shards import Shards
from jaxps_runtime.ps.snapshots import Snapshot
from jaxps_runtime.ps.updates import Updater


class Checkpointing:
    """The store's snapshots and restores; the store holds what they use."""

    task: str
    shards: Shards
    updates: Updater
    _lock: threading.RLock
    _changed: threading.Condition
    _state: ps_pb2.PsState
    _epoch: int
    _step: int
    _policy: Policy
    _positions: Positions
    _saves: snapshots.Saves
    _untouched: bool

    def optimizer_json(self) -> str:
        raise NotImplementedError  # the store's

    def _snapshot_locked(self) -> Snapshot:
        return Snapshot.of(
            self.shards.table(),
            step=self._step,
            epoch=self._epoch,
            optimizer=self.optimizer_json(),
            cursors=self._positions.snapshot(),
        )

    def snapshot_at(self, step: int, *, is_active: Callable[[], bool]) -> Snapshot:
        """The state as it is when the step becomes `step` (at once if it is `step` now): exact
        in every mode (unlike TensorFlow's async cut), never with an update its step and data
        positions do not count (`Policy.in_flight`; async admission waits for the cut)."""
        with self._lock:
            if self._state != ps_pb2.READY:
                raise PsError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Save: {self.task} is {STATE_NAMES[self._state]}",
                )
            if self._step > step:
                raise PsError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Save: {self.task} is at step {self._step}, past step {step}",
                )
            if self._step == step:
                in_flight = self._policy.in_flight()
                if in_flight:
                    raise snapshots.fuzzy(step, in_flight)
                return self._snapshot_locked()
            future = self._saves.ask(step)
            self._changed.notify_all()  # async admission now holds pushes past `step` back
        return snapshots.wait(
            future,
            task=self.task,
            is_active=is_active,
            stopping=lambda: self._state == ps_pb2.SHUTTING_DOWN,
        )

    def restore(
        self,
        *,
        step: int,
        values: Mapping[str, np.ndarray],
        states: Mapping[str, list[np.ndarray]],
        where: str,
        cursors: Mapping[str, int] | None = None,
        tables: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    ) -> None:
        """Loads every declared shard and its optimizer state (`snapshots.loaded`), and every
        dynamic table's part (`tables`: `dynamic.Table.snapshot`'s arrays by shard); READY at
        `step`, with this ps's data positions of the checkpoint."""
        with self._lock:
            tensors, jitted = self.shards.table(), self.updates.current
            # A ps whose shards are all dynamic tables' is READY from its Init (their values
            # need no Assign): restored before anything is counted, it is as if ASSIGNING.
            fresh = self._state == ps_pb2.READY and self._untouched
            if (self._state != ps_pb2.ASSIGNING and not fresh) or jitted is None:
                raise PsError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Restore: {self.task} is {STATE_NAMES[self._state]}; Init first",
                )
        loaded = snapshots.loaded(
            tensors, self.updates.applier_for, values=values, states=states, where=where
        )
        parts = {n: h.dynamic for n, h in tensors.items() if h.dynamic is not None}
        missing = sorted(set(parts) - set(tables or {}))
        if missing:
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Restore: {where} has no dynamic table part {missing[0]!r}; the placement differs",
            )

        def swap() -> None:
            with self._changed:
                table = self.shards.table()
                for name, (value, state) in loaded.items():
                    table[name].value, table[name].opt_state = value, state
                for name, part in parts.items():
                    try:
                        part.restore([(tables or {})[name]])
                    except (KeyError, ValueError, IndexError) as err:
                        raise PsError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"Restore: {where}: dynamic table part {name!r} does not fit ({err})",
                        ) from err
                self._step = step
                self._positions.reset(cursors or {})
                self._state = ps_pb2.READY
                self._changed.notify_all()

        self.updates.run(swap).result()
