"""The state of one ps task: its shards, their optimizer state, its step, epoch and counters.

The store holds the state and its locking; its parts hold the rest: the declared shards
(`shards.Shards`), the update executor (`updates.Updater`: queued optimizer updates, settling
them, the non-finite check), the pushes it remembers (`pushes.PushLog`) and the snapshots asked
for checkpoints (`snapshots`). How pushes become updates is the current mode's `policy.Policy`
(`modes.asynchronous`, `modes.bounded`, `modes.sync`), built at Init.

Thread-safety contract (every method may be called from any of grpc's threads at once):
- A shard's value is an immutable jax array. An update computes a new array and swaps the
  reference under `_lock`; readers take references under the lock and read them without it.
  So a pull sees whole shards, each of one version, and never blocks or is blocked by an update.
- Except for embedding shards updated by rows: copying a whole table per update of a few rows
  would cost more than everything else in a step, so those are host (numpy) arrays updated in
  place, as TensorFlow's sparse apply ops do. Their rows are written under `_lock`, and readers
  copy what they read of them (the rows asked for, or the whole shard) under the lock too.
- Every write of (value, optimizer state) runs on one applier thread, in submission order, so
  no read-modify-write ever races. A push handler goes on receiving the next shard's chunks
  while the applier updates the previous one (jax releases the GIL while it computes).
- Nothing non-finite is stored: an update whose new value of a shard has a NaN or an inf (an
  optimizer step that overflowed) is refused by the applier (`updates.Updater`) and the shard
  keeps its value and optimizer state (`terms.NONFINITE_UPDATE`); the servicer refuses
  non-finite gradients before it queues anything (`updates.finite`, `terms.NONFINITE_GRADIENT`).
- `_changed` (a Condition on `_lock`) is notified on every step or state change; reads that
  wait for a minimum step sleep on it. Policies take `lock` for their own state too (it is
  re-entrant, so they may call `count_push` holding it); a policy's own lock, when it has
  one, is taken before it.
Errors are `PsError`s carrying the gRPC status code the servicer answers with.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import grpc
import jax
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.ps import dynamic, optim, snapshots
from jaxps_runtime.ps.checkpointing import Checkpointing
from jaxps_runtime.ps.held import Counters, Held
from jaxps_runtime.ps.modes.asynchronous import Async
from jaxps_runtime.ps.modes.bounded import Bounded
from jaxps_runtime.ps.modes.policy import Policy, PsError
from jaxps_runtime.ps.modes.sync import Sync
from jaxps_runtime.ps.positions import Claim, Positions
from jaxps_runtime.ps.pushes import PushLog
from jaxps_runtime.ps.shards import Picked, Shards
from jaxps_runtime.ps.updates import Updater
from jaxps_runtime.wire import streams
from jaxps_runtime.wire.streams import Spec
from jaxps_runtime.wire.terms import Mode

POLICIES: dict[int, type[Async] | type[Sync]] = {
    ps_pb2.ASYNC: Async,
    ps_pb2.BOUNDED_STALENESS: Bounded,
    ps_pb2.SYNC: Sync,
}


class ParameterStore(Checkpointing):
    """What one ps holds, and the only code that changes it; its snapshots for checkpoints
    and its restores are `checkpointing.Checkpointing`'s."""

    def __init__(self, *, job_id: str, task: str, incarnation: int | None = None) -> None:
        self.job_id = job_id
        self.task = task
        self.incarnation = incarnation or (secrets.randbits(62) | 1)
        self.counters = Counters()
        self._lock = threading.RLock()  # re-entered by policies (see `count_push`)
        self._changed = threading.Condition(self._lock)
        self._state: ps_pb2.PsState = ps_pb2.UNINITIALIZED
        self._epoch = 0
        self._step = 0
        self.shards = Shards(task=task, lock=self._lock)
        self._optimizer: OptimizerConfig | None = None
        self._pushes = PushLog()  # guarded by `_lock`
        self.updates = Updater(
            task=task, lock=self._lock, counters=self.counters, pushes=self._pushes
        )
        self.updates.step = lambda: self._step
        self._mode = Mode()
        self._policy: Policy = Async(self, self._mode, ())
        # Each data shard's position as of the pushes counted so far: changed with the step,
        # under the same lock, so a snapshot holds the positions that match its values.
        self._positions = Positions()
        self._saves = snapshots.Saves()  # guarded by `_lock`
        self._untouched = False  # READY from Init with nothing counted since (guarded by `_lock`)

    # --- identity and state ------------------------------------------------------------

    def identity(self) -> tensor_pb2.Identity:
        epoch, _ = self.standing()
        return tensor_pb2.Identity(
            job_id=self.job_id,
            ps_incarnation=self.incarnation,
            cluster_epoch=epoch,
            task=self.task,
        )

    @property
    def state(self) -> ps_pb2.PsState:
        return self._state

    @property
    def step(self) -> int:
        return self._step

    @property
    def lock(self) -> threading.RLock:
        """Guards the step, the values and the cursors; policies take it for their own state."""
        return self._lock

    @property
    def changed(self) -> threading.Condition:
        """Notified on every step or state change (on `lock`)."""
        return self._changed

    @property
    def policy(self) -> Policy:  # the current mode's decisions (a new one per Init)
        return self._policy

    @property
    def mode(self) -> Mode:
        return self._mode

    def optimizer_json(self) -> str:
        return self._optimizer.to_json() if self._optimizer else ""

    def standing(self) -> tuple[int, ps_pb2.PsState]:
        """The cluster epoch and state, read together (`callers.check`)."""
        with self._lock:
            return self._epoch, self._state

    # --- init and assign ---------------------------------------------------------------

    def init(
        self,
        *,
        epoch: int,
        specs: Sequence[Spec],
        optimizer: OptimizerConfig,
        step: int,
        mode: Mode | None = None,
        workers: Sequence[str] = (),
        by_rows: Collection[str] | None = None,
        overrides: Mapping[str, OptimizerConfig] | None = None,
        tables: Mapping[str, tuple[dynamic.Spec, int, int]] | None = None,
    ) -> None:
        """Declares the shards and optimizer (`overrides`: others' for some shards); values come
        through `assign`. `by_rows`: the shards pushes update by rows (embedding tables'), the
        others whole. None declares neither (either kind of update is taken). `tables`: the
        dynamic tables' parts ({shard: (spec, ps, num_ps)}), valued from the start."""
        if (dup := streams.first_duplicate(s.name for s in specs)) is not None:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Init.tensors: {dup!r} twice")
        jitted = self.updates.compiled(optimizer)
        by_shard = {name: self.updates.compiled(o) for name, o in (overrides or {}).items()}
        mode = mode or Mode()
        policy = POLICIES[mode.kind](self, mode, workers)
        made = {}
        for name, (spec, ps, num_ps) in (tables or {}).items():
            own = (overrides or {}).get(name, optimizer)
            made[name] = dynamic.Table(
                spec,
                optim.build(own),
                ps=ps,
                num_ps=num_ps,
                applier=self.updates.compiled(own).applier,
            )

        def swap() -> None:
            with self._changed:
                self._saves.fail(f"the chief re-initialised {self.task} (epoch {epoch})")
                self._mode, self._policy = mode, policy
                self._positions.reset({})
                self.shards.declare(specs, by_rows=by_rows, tables=made)
                self._optimizer, self.updates.current = optimizer, jitted
                self.updates.by_shard = by_shard
                self._epoch, self._step = epoch, step
                self._pushes.clear()
                self._untouched = True  # a Restore may still come (nothing applied since)
                self._state = ps_pb2.READY if self.shards.all_assigned() else ps_pb2.ASSIGNING
                self._changed.notify_all()

        self.updates.run(swap).result()

    def assign(self, name: str, array: np.ndarray) -> Future[None]:
        """Sets a declared shard's value (copied) and resets its optimizer state."""

        def run() -> None:
            with self._lock:
                held, jitted = self.shards.find(name), self.updates.jitted_for(name)
            if held is None or jitted is None:
                return  # a new Init replaced the declared shards meanwhile
            # One copy, into an aligned array nothing else refers to, which device_put then
            # uses in place (the source may be a view of received bytes).
            private = streams.empty(held.spec.shape, held.spec.dtype)
            np.copyto(private, np.asarray(array).reshape(held.spec.shape))
            value = jax.device_put(private)
            state = jitted.applier.init(value)
            with self._changed:
                held.value, held.opt_state = value, state
                if self._state == ps_pb2.ASSIGNING and self.shards.all_assigned():
                    self._state = ps_pb2.READY
                    self._changed.notify_all()

        return self.updates.run(run)

    # --- push -----------------------------------------------------------------------------

    def find(self, name: str) -> Held | None:
        return self.shards.find(name)

    def apply_dense(
        self, held: Held, grad: np.ndarray, *, push_id: str, who: str = "an update"
    ) -> Future[None]:
        """`updates.Updater.dense`: queues the update of one shard with one gradient."""
        return self.updates.dense(held, grad, push_id=push_id, who=who)

    def settle(self, pending: Iterable[Future[None]]) -> None:
        """`updates.Updater.settle`: waits for a push's updates, raises the first error."""
        self.updates.settle(pending)

    def count_push(self, push_id: str, claims: Iterable[Claim]) -> tuple[bool, int]:
        """Counts one push (or, in sync mode, a step's pushes, with no push_id) whose updates
        are applied: the step advances by one and the data positions of `claims` with it. A
        push whose id counted before is a duplicate and counts nothing: (whether it counted,
        the step after it). Callers may hold `lock`.

        Every ps counts every push, including pushes that carry none of its shards, so the ps
        steps stay equal.
        """
        with self._changed:
            duplicate = self._pushes.counted(push_id)
            if not duplicate:
                self._untouched = False
                self._step += 1
                self._positions.settle(claims)
                self._saves.reached(
                    self._step, self._snapshot_locked, in_flight=self._policy.in_flight()
                )
                self._changed.notify_all()
            else:
                for claim in claims:
                    self._positions.drop(claim)
            self._pushes.note_counted(push_id)
            return not duplicate, self._step

    # --- data positions ---------------------------------------------------------------------

    def claim(self, *, shard: str, cursor: int, lease: int) -> Claim | str:
        with self._lock:  # `positions.Positions.claim`: the batch's claim or why not
            return self._positions.claim(shard=shard, cursor=cursor, lease=lease)

    def drop(self, claim: Claim | None) -> None:
        with self._lock:  # a claimed push that will not count: its batch is free again
            self._positions.drop(claim)

    def next_save(self) -> int | None:
        return self._saves.lowest()  # the lowest step a snapshot waits for (under the lock)

    def cursors(self) -> dict[str, int]:
        with self._lock:  # each data shard's position: the batches of it applied here
            return self._positions.snapshot()

    # --- pull -----------------------------------------------------------------------------

    def wait_for_step(self, min_step: int, *, is_active: Callable[[], bool]) -> int:
        """Blocks until the step is at least `min_step` (or the call ends or the ps stops)."""
        with self._changed:
            epoch = self._epoch
            while self._step < min_step:
                if self._epoch != epoch:
                    raise PsError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"Read: cluster epoch changed to {self._epoch} (rolled back to step "
                        f"{self._step}) while waiting for step {min_step}; read again",
                    )
                if self._state == ps_pb2.SHUTTING_DOWN:
                    raise PsError(grpc.StatusCode.UNAVAILABLE, f"{self.task} is shutting down")
                if not is_active():
                    raise PsError(grpc.StatusCode.CANCELLED, "the caller went away")
                self._changed.wait(timeout=0.5)
            return self._step

    def snapshot(
        self, names: Iterable[str], rows: Sequence[tuple[str, np.ndarray]] = ()
    ) -> tuple[int, list[tuple[Spec, Any]], list[Picked]]:
        """The current step, the values of the named shards and the rows (name, row ids) of
        shards, all taken atomically (`shards.Shards.read`)."""
        with self._lock:
            values, picked = self.shards.read(names, rows)
            return self._step, values, picked

    # --- shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._changed:
            self._state = ps_pb2.SHUTTING_DOWN
            self._changed.notify_all()

    def close(self) -> None:
        self.updates.close()
