"""The state of one ps task: its shards, their optimizer state, its step, epoch and counters.

The store holds the state and its locking and applies updates; how pushes become updates is
the current mode's `policy.Policy` (`mode_async`, `mode_bounded`, `mode_sync`), built at Init.

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
  optimizer step that overflowed) is refused by the applier and the shard keeps its value and
  optimizer state (`terms.NONFINITE_UPDATE`); the servicer refuses non-finite gradients before
  it queues anything (`finite`, `terms.NONFINITE_GRADIENT`).
- `_changed` (a Condition on `_lock`) is notified on every step or state change; reads that
  wait for a minimum step sleep on it. Policies take `lock` for their own state too (it is
  re-entrant, so they may call `count_push` holding it); a policy's own lock, when it has
  one, is taken before it.
Errors are `PsError`s carrying the gRPC status code the servicer answers with.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.ps import optim
from jaxps_runtime.ps.held import Counters, Held
from jaxps_runtime.ps.modes.asynchronous import Async
from jaxps_runtime.ps.modes.bounded import Bounded
from jaxps_runtime.ps.modes.policy import Policy, PsError
from jaxps_runtime.ps.modes.sync import Sync
from jaxps_runtime.wire import rpc, streams
from jaxps_runtime.wire.streams import Spec
from jaxps_runtime.wire.terms import NONFINITE_UPDATE, Mode

log = logging.getLogger(__name__)
STATE_NAMES = {v: k for k, v in ps_pb2.PsState.items()}
POLICIES: dict[int, type[Async] | type[Sync]] = {
    ps_pb2.ASYNC: Async,
    ps_pb2.BOUNDED_STALENESS: Bounded,
    ps_pb2.SYNC: Sync,
}
_REMEMBERED_PUSHES = 4096


def finite(array: np.ndarray) -> bool:
    """Whether every element of `array` is finite (integers always are).

    For numpy's own floats, min and max: both propagate a NaN and one of them meets any inf,
    and they read the array once without writing a boolean array as `isfinite` does (about
    0.5 ms for the 17 MB of the dense mlp's gradients, against 0.7)."""
    if array.dtype.kind in "iub" or array.size == 0:
        return True
    if array.dtype.kind == "f":
        return bool(np.isfinite(array.min()) and np.isfinite(array.max()))
    return bool(np.isfinite(array).all())  # bfloat16 and other ml_dtypes


class _Updates(NamedTuple):
    """An optimizer's jitted updates: `applier`'s, and its dense update with whether the new
    value is all finite, in the same jitted call. The largest magnitude is NaN or inf exactly
    when an element is; on XLA's CPU backend it costs about a fifth of an sgd update (0.4 ms
    for the dense mlp's 17 MB), where `isfinite(...).all()` costs more than the update."""

    applier: optim.Applier
    dense: Callable[[Any, Any, Any], tuple[Any, Any, Any]]

    @classmethod
    def of(cls, applier: optim.Applier) -> _Updates:
        def dense(param: Any, state: Any, grad: Any) -> tuple[Any, Any, Any]:
            value, state = applier.dense(param, state, grad)
            return value, state, jnp.isfinite(jnp.max(jnp.abs(value), initial=0))

        return cls(applier, jax.jit(dense))


@dataclass(frozen=True)
class Snapshot:
    """A ps's shards and optimizer states as they were when its step was `step`.

    Values and states are immutable jax arrays (holding references is the whole copy) or
    copies of the host arrays that row updates change in place.
    """

    step: int
    epoch: int
    optimizer: str
    values: dict[str, jax.Array]
    states: dict[str, Any]
    cursors: dict[str, int] = field(default_factory=dict)  # workers' data cursors at `step`


class ParameterStore:
    """What one ps holds, and the only code that changes it."""

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
        self._tensors: dict[str, Held] = {}
        self._optimizer: OptimizerConfig | None = None
        self._applier: optim.Applier | None = None
        self._updates: _Updates | None = None
        self._appliers: dict[str, _Updates] = {}  # by optimizer JSON: re-init reuses jits
        # push_id -> shards it updated; `_finished` holds the ids whose push has counted a step.
        self._pushes: OrderedDict[str, set[str]] = OrderedDict()
        self._finished: set[str] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{task}-apply")
        self._mode = Mode()
        self._policy: Policy = Async(self, self._mode, ())
        # Each worker's data cursor as of the pushes counted so far: changed with the step,
        # under the same lock, so a snapshot holds the cursors that match its values.
        self._cursors: dict[str, int] = {}
        self._snapshots: dict[int, Future[Snapshot]] = {}  # step -> taken when it is reached

    # --- identity and state ------------------------------------------------------------

    def identity(self) -> tensor_pb2.Identity:
        with self._lock:
            epoch = self._epoch
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
    def policy(self) -> Policy:
        """The current mode's decisions (a new one per Init)."""
        return self._policy

    @property
    def mode(self) -> Mode:
        return self._mode

    def check(
        self,
        caller: tensor_pb2.Identity,
        *,
        method: str,
        ready: bool = True,
        allow_anonymous: bool = False,
    ) -> None:
        """Refuses callers of another job, of another ps incarnation or epoch, or too early."""
        if not (allow_anonymous and not caller.job_id) and caller.job_id != self.job_id:
            self.counters.add("refused_job")
            raise PsError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: job id {caller.job_id!r} is not this ps's job {self.job_id!r}; "
                "refusing a client of another job",
            )
        if caller.ps_incarnation and caller.ps_incarnation != self.incarnation:
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{method}: {self.task} restarted (incarnation {self.incarnation}, caller saw "
                f"{caller.ps_incarnation}); re-register and pull again",
                reason=rpc.PS_RESTARTED,
            )
        with self._lock:
            epoch, state = self._epoch, self._state
        if ready and caller.cluster_epoch and caller.cluster_epoch != epoch:
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{method}: cluster epoch is {epoch}, caller is at {caller.cluster_epoch}; "
                "pull again",
            )
        if ready and state != ps_pb2.READY:
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{method}: {self.task} is {STATE_NAMES[state]}; the chief has not initialised "
                "or restored it yet"
                if state != ps_pb2.SHUTTING_DOWN
                else f"{method}: {self.task} is shutting down",
            )

    def held(self, name: str, *, where: str) -> Held:
        held = self._tensors.get(name)
        if held is None:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {self.task} holds no shard {name!r} ({len(self._tensors)} shards held)",
            )
        return held

    def size(self) -> int:
        """How many shards this ps holds: the most tensors one request may name."""
        return len(self._tensors)

    def matching(self, spec: Spec, *, where: str, rows: bool = False) -> Held:
        """The held shard `spec` names, if its dtype and shape fit (row shape for `rows`)."""
        held = self.held(spec.name, where=where)
        want = held.spec.shape[1:] if rows else held.spec.shape
        got = spec.shape[1:] if rows else spec.shape
        if got != want or spec.dtype != held.spec.dtype:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: shard {spec.name!r} is {held.spec.dtype.name}{list(held.spec.shape)}"
                f", got {spec.dtype.name}{list(spec.shape)}",
            )
        return held

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
    ) -> None:
        """Declares the shards and optimizer; values arrive through `assign`. `by_rows`: the
        shards pushes update by rows (embedding tables'); every other one is updated whole.
        None declares neither (either kind of update is taken)."""
        dup = streams.first_duplicate(s.name for s in specs)
        if dup is not None:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Init.tensors: {dup!r} twice")
        key = optimizer.to_json()
        updates = self._appliers.get(key)
        if updates is None:
            updates = self._appliers[key] = _Updates.of(optim.Applier(optim.build(optimizer)))

        mode = mode or Mode()
        policy = POLICIES[mode.kind](self, mode, workers)

        def swap() -> None:
            with self._changed:
                self._fail_snapshots(f"the chief re-initialised {self.task} (epoch {epoch})")
                self._mode, self._policy = mode, policy
                self._cursors = {}
                self._tensors = {
                    s.name: Held(s, by_rows=None if by_rows is None else s.name in by_rows)
                    for s in specs
                }
                self._optimizer, self._applier, self._updates = optimizer, updates.applier, updates
                self._epoch, self._step = epoch, step
                self._pushes.clear()
                self._finished.clear()
                self._state = ps_pb2.ASSIGNING if specs else ps_pb2.READY
                self._changed.notify_all()

        self._executor.submit(swap).result()

    def assign(self, name: str, array: np.ndarray) -> Future[None]:
        """Sets a declared shard's value (copied) and resets its optimizer state."""

        def run() -> None:
            with self._lock:
                held = self._tensors.get(name)
                applier = self._applier
            if held is None or applier is None:
                return  # a new Init replaced the declared shards meanwhile
            # One copy, into an aligned array nothing else refers to, which device_put then
            # uses in place (the source may be a view of received bytes).
            private = streams.empty(held.spec.shape, held.spec.dtype)
            np.copyto(private, np.asarray(array).reshape(held.spec.shape))
            value = jax.device_put(private)
            state = applier.init(value)
            with self._changed:
                held.value, held.opt_state = value, state
                if self._state == ps_pb2.ASSIGNING and all(
                    h.value is not None for h in self._tensors.values()
                ):
                    self._state = ps_pb2.READY
                    self._changed.notify_all()

        return self._executor.submit(run)

    def unassigned(self) -> list[str]:
        with self._lock:
            return sorted(n for n, h in self._tensors.items() if h.value is None)

    # --- push -----------------------------------------------------------------------------

    def already_applied(self, push_id: str) -> set[str]:
        """Shards a push with this id has updated already (a retry skips them)."""
        with self._lock:
            return set(self._pushes.get(push_id, ())) if push_id else set()

    def apply_dense(
        self, held: Held, grad: np.ndarray, *, push_id: str, who: str = "an update"
    ) -> Future[None]:
        """Queues the optimizer update of one shard with one gradient (`who`: whose update it
        is, for the refusal's message). The future raises a `NONFINITE_UPDATE` PsError, and
        nothing changes, if the new value is not finite."""
        # numpy goes straight into the jitted update: jit transfers it far faster than jnp.asarray.
        return self._submit(
            held,
            push_id,
            lambda u, v, s: u.dense(v, s, grad),
            who=who,
            done=lambda: held.recycle(grad),
        )

    def apply_sparse(
        self,
        held: Held,
        ids: np.ndarray,
        grads: np.ndarray,
        *,
        push_id: str,
        who: str = "an update",
    ) -> Future[None]:
        """Queues the in-place update of rows `ids` of one shard; duplicate ids are summed
        first. The first one turns the shard into a host array (one copy). New rows that are
        not finite are not written (as `apply_dense`)."""
        unique, summed = optim.sum_duplicate_rows(ids, grads)

        def update(updates: _Updates, value: Any, state: Any) -> tuple[np.ndarray, Any, bool]:
            applier = updates.applier
            if not isinstance(value, np.ndarray):
                value, state = optim.host_copy(value, state)
            # Only this thread writes: reading the rows needs no lock, writing them does.
            new_rows, new_state = applier.sparse_rows(value, state, unique, summed)
            if not finite(new_rows):
                return value, state, False
            with self._lock:
                return value, applier.scatter(value, state, unique, new_rows, new_state), True

        return self._submit(held, push_id, update, who=who)

    def _submit(
        self,
        held: Held,
        push_id: str,
        update: Callable[[_Updates, Any, Any], tuple[Any, Any, Any]],
        *,
        who: str,
        done: Callable[[], None] | None = None,
    ) -> Future[None]:
        def run() -> None:
            updates = self._updates
            if held.value is None or updates is None:
                return
            started = time.perf_counter()
            value, state, ok = update(updates, held.value, held.opt_state)
            if isinstance(value, jax.Array):
                value.block_until_ready()
            if not bool(ok):
                name = held.spec.name
                raise PsError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"Update: the update is not finite: the optimizer's step on {name!r} "
                    f"({who}) gives NaN or inf; {self.task} keeps {name!r} and its optimizer "
                    "state as they were (is the learning rate too large?)",
                    reason=NONFINITE_UPDATE,
                )
            with self._lock:
                held.value, held.opt_state = value, state
                if push_id:
                    self._pushes.setdefault(push_id, set()).add(held.spec.name)
            self.counters.add("apply_seconds", time.perf_counter() - started)
            if done is not None:
                done()

        return self._executor.submit(run)

    def settle(self, pending: Iterable[Future[None]]) -> None:
        """Waits for every queued update of one push (or step); then raises the first error,
        a refused non-finite update counted once."""
        first: BaseException | None = None
        for future in pending:
            try:
                future.result()
            except BaseException as err:  # raised below, once the others are done
                first = first or err
        if first is None:
            return
        if isinstance(first, PsError) and first.reason == NONFINITE_UPDATE:
            self.refused(NONFINITE_UPDATE)
            log.warning("%s: %s", self.task, first.message)
        raise first

    def refused(self, reason: str) -> None:
        """Counts one update refused for `reason` (one of `terms.REFUSALS`)."""
        self.counters.add(f"refused_{reason}")

    def count_push(self, push_id: str, cursors: Mapping[str, int]) -> tuple[bool, int]:
        """Counts one push (or, in sync mode, a step's pushes, with no push_id) whose updates
        are applied: the step advances by one and each worker's data cursor of `cursors`
        with it. A push whose id counted before is a duplicate and counts nothing: (whether it
        counted, the step after it). Callers may hold `lock`.

        Every ps counts every push, including pushes that carry none of its shards, so the ps
        steps stay equal.
        """
        with self._changed:
            duplicate = bool(push_id) and push_id in self._finished
            if not duplicate:
                self._step += 1
                for worker, cursor in cursors.items():
                    self._note_cursor_locked(worker, cursor)
                self._take_snapshot_if_asked()
                self._changed.notify_all()
            if push_id:
                self._pushes.setdefault(push_id, set())
                self._pushes.move_to_end(push_id)
                self._finished.add(push_id)
                while len(self._pushes) > _REMEMBERED_PUSHES:
                    forgotten, _ = self._pushes.popitem(last=False)
                    self._finished.discard(forgotten)
            return not duplicate, self._step

    # --- data cursors -----------------------------------------------------------------------

    def _note_cursor_locked(self, worker: str, cursor: int) -> None:
        if worker and cursor > self._cursors.get(worker, 0):
            self._cursors[worker] = cursor

    def note_cursor(self, worker: str, cursor: int) -> None:
        """A push that does not count (refused as stale or as past the last step) still used
        its batch: the worker goes on after it, and so does a restart of it."""
        with self._lock:
            self._note_cursor_locked(worker, cursor)

    def cursors(self) -> dict[str, int]:
        """Each worker's data cursor: the batches it has used whose pushes this ps counted."""
        with self._lock:
            return dict(self._cursors)

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
    ) -> tuple[int, list[tuple[Spec, Any]], list[tuple[Spec, np.ndarray]]]:
        """The current step, the values of the named shards and the rows (name, row ids) of
        shards, all taken atomically."""
        with self._lock:
            out = [(h.spec, _readable(h.value)) for h in map(self._valued, names)]
            picked = []
            for name, ids in rows:
                held = self._valued(name)
                picked.append((held.spec, np.asarray(held.value)[ids]))
            return self._step, out, picked

    def find(self, name: str) -> Held | None:
        return self._tensors.get(name)

    def _valued(self, name: str) -> Held:
        held = self.held(name, where="Read")
        if held.value is None:
            raise PsError(grpc.StatusCode.FAILED_PRECONDITION, f"Read: {name!r} has no value yet")
        return held

    def specs(self) -> list[Spec]:
        with self._lock:
            return [h.spec for h in self._tensors.values()]

    def optimizer_json(self) -> str:
        return self._optimizer.to_json() if self._optimizer else ""

    # --- checkpoints ------------------------------------------------------------------------

    def _snapshot_locked(self) -> Snapshot:
        held = self._tensors.items()
        return Snapshot(
            step=self._step,
            epoch=self._epoch,
            optimizer=self.optimizer_json(),
            values={n: _readable(h.value) for n, h in held if h.value is not None},
            states={n: jax.tree_util.tree_map(_readable, h.opt_state) for n, h in held},
            cursors=dict(self._cursors),
        )

    def _take_snapshot_if_asked(self) -> None:
        """With `_lock` held, right after the step changed."""
        future = self._snapshots.pop(self._step, None)
        if future is not None:
            future.set_result(self._snapshot_locked())

    def _fail_snapshots(self, why: str) -> None:
        for step, future in self._snapshots.items():
            future.set_exception(PsError(grpc.StatusCode.ABORTED, f"Save at step {step}: {why}"))
        self._snapshots.clear()

    def snapshot_at(self, step: int, *, is_active: Callable[[], bool]) -> Snapshot:
        """The state as it is when the step becomes `step` (at once if it is `step` now).

        In sync mode the cut is consistent: every update of a step lands before the step
        advances. In async mode it is fuzzy, as TensorFlow's is: a push in flight may have
        updated some shards already.
        """
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
                return self._snapshot_locked()
            future = self._snapshots.setdefault(step, Future())
        while True:
            try:
                return future.result(timeout=0.5)
            except TimeoutError:
                if not is_active():
                    raise PsError(grpc.StatusCode.CANCELLED, "the caller went away") from None
                if self._state == ps_pb2.SHUTTING_DOWN:
                    raise PsError(
                        grpc.StatusCode.UNAVAILABLE, f"{self.task} is shutting down"
                    ) from None

    def restore(
        self,
        *,
        step: int,
        values: Mapping[str, np.ndarray],
        states: Mapping[str, list[np.ndarray]],
        where: str,
        cursors: Mapping[str, int] | None = None,
    ) -> None:
        """Loads every declared shard and its optimizer state; READY at `step`, with the
        workers' data cursors of the checkpoint."""
        with self._lock:
            tensors, applier = dict(self._tensors), self._applier
            if self._state != ps_pb2.ASSIGNING or applier is None:
                raise PsError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Restore: {self.task} is {STATE_NAMES[self._state]}; Init first",
                )
        missing = sorted(set(tensors) - set(values))
        if missing:
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Restore: {where} has no shard {missing[0]!r}; the placement differs",
            )
        loaded: dict[str, tuple[jax.Array, Any]] = {}
        for name, held in tensors.items():
            array = values[name]
            if tuple(array.shape) != held.spec.shape or array.dtype != held.spec.dtype:
                raise PsError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Restore: {where}: shard {name!r} is {array.dtype}{list(array.shape)}, "
                    f"declared {held.spec.dtype.name}{list(held.spec.shape)}",
                )
            value = jax.device_put(array)
            template = applier.init(value)
            leaves, treedef = jax.tree_util.tree_flatten(template)
            saved = states.get(name, [])
            if len(saved) != len(leaves) or any(
                np.shape(a) != np.shape(b) for a, b in zip(saved, leaves, strict=True)
            ):
                raise PsError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"Restore: {where}: the optimizer state of {name!r} does not fit the "
                    "optimizer (was it saved with another one?)",
                )
            state = jax.tree_util.tree_unflatten(
                treedef, [jax.device_put(np.asarray(a)) for a in saved]
            )
            loaded[name] = (value, state)

        def swap() -> None:
            with self._changed:
                for name, (value, state) in loaded.items():
                    self._tensors[name].value, self._tensors[name].opt_state = value, state
                self._step = step
                self._cursors = dict(cursors or {})
                self._state = ps_pb2.READY
                self._changed.notify_all()

        self._executor.submit(swap).result()

    # --- shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._changed:
            self._state = ps_pb2.SHUTTING_DOWN
            self._changed.notify_all()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _readable(value: Any) -> Any:
    """What a reader may keep and read without the lock: a copy of a host array (updated in
    place later), the value itself when it is an immutable jax array."""
    return np.array(value) if isinstance(value, np.ndarray) else value
