"""The worker: read, `jax.value_and_grad` under `jax.jit`, update; on shards the chief leases it.

Between-graph replication as TensorFlow's workers do it, against the ps tier, one Read and one
Update per ps and step, on the batches of the shards the chief's queue leases it (`feed`): each
push names its batch (shard, position, lease) and every ps applies a batch once (`ps.positions`),
so every record is applied once per data epoch however workers come, go or die:
- dense variables are read whole (into buffers reused across steps); an embedding table is
  read by rows: only the unique ids of the batch, padded to one size per table so the jitted
  step compiles once, and the batch's ids are remapped to positions in those rows;
- sync: the update brings back the values of the next step (the ps replies once enough workers
  have pushed); a push refused as stale computes its batch again at the current step;
- async and bounded staleness: read whatever is there (the ps holds a worker back that is too
  far ahead), update, repeat.
The worker stops when the global step reaches `steps` or the chief says stop. Told to stop
(SIGTERM: the job is scaled down, suspended or preempted) it drains between two steps: its last
push is in, it gives its leases back (each shard goes on from where it got) and leaves the job,
then exits 0; on SIGINT the same, with the interrupt's exit code. A background thread
heartbeats to the chief with the step, the loss and the per-step time split.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from typing import Any

import grpc
import numpy as np

from jaxps_runtime.client.psclient import PsClientError, PsRestartedError
from jaxps_runtime.config.mode import ModeKind
from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.process import stopping
from jaxps_runtime.train import divergence, outcome, timing
from jaxps_runtime.train.feed import Feed, Position, TrainingOverError, refused_position
from jaxps_runtime.train.task import Task

log = logging.getLogger(__name__)


# Failures of the ps tier a worker waits out: a ps down or restarted, or rolled back by the chief.
RECOVERABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        None,  # the reply showed another incarnation
    }
)


_DIVERGED = -2  # `_step`'s answer when it reported a divergence for a rollback


class Worker:
    """One worker's training loop (also run by worker 0 when the job has no chief)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.index = task.spec.task.index
        self.client = task.ps_client()
        self.plan = ShardPlan.of(
            task.dataset, batch_size=task.training.batchSize, seed=task.training.seed
        )
        self.coordinator = task.coordinator()
        self.feed = Feed(self.coordinator, name=task.name)
        self.finished = threading.Event()  # the chief says training is over
        self.step = 0
        self.loss = math.nan
        self.times = timing.StepTimes()
        self._grad = divergence.finite_step(task.model.loss)
        self.waiting = ""  # what the worker waits for now: its heartbeats say it
        self.drained = False  # its training is over; it waits for the chief to end the job
        self.last_heard = time.monotonic()  # the chief's last answer to a heartbeat
        self.diverged: dict[str, float] = {}  # the report of a divergence not rolled back yet
        self.position: Position | None = None  # the batch of the step under way
        self._table_rows = {
            v.name: v.shape[0] for v in task.placement.variables if v.name in task.tables
        }

    def _beat(self, *, done: bool) -> Any:
        """One heartbeat: the step, the loss, the step times, what it waits for."""
        return self.coordinator.heartbeat(
            step=self.step,
            loss=self.loss,
            done=done,
            metrics={**self.times.means(), **self.diverged},
            examples_per_second=self.times.examples_per_second(),
            waiting="" if done else self.waiting,
        )

    def _heartbeats(self, *, every: float) -> None:
        while not self.finished.wait(every):
            self.task.metrics.examples_per_second.set(self.times.examples_per_second())
            state = self._beat(done=self.drained)
            if state is not None:
                self.last_heard = time.monotonic()
            if state is not None and state.stop:
                log.info("%s: the chief says training is over", self.task.name)
                self.finished.set()

    def run(self) -> int:
        training = self.task.training
        coordinator = self.coordinator
        beat: threading.Thread | None = None
        trained = False
        try:
            coordinator.register(timeout=training.startupTimeoutSeconds)
            # heartbeats from registration on: a worker waiting for the ps is alive
            beat = threading.Thread(
                target=self._heartbeats,
                kwargs={"every": training.heartbeatSeconds},
                daemon=True,
            )
            beat.start()
            self.waiting = "every ps to be ready (the chief initialises or restores them)"
            self.step = self.client.wait_ready(timeout=training.startupTimeoutSeconds)
            where = f"{self.task.name}: ps ready at step {self.step} (epoch {self.client.epoch})"
            log.info("%s; training %s on the chief's shards (%s)", where, training.mode, self.plan)
            _compile_short_batch(self)
            self._loop()
            while self._drain():
                self._loop()
            trained = True
        except stopping.Stopped:
            self.finished.set()
            self._leave()
            if self.task.stop.exit_code != 128 + signal.SIGTERM:
                raise
            log.info("%s: drained on %s: exit 0", self.task.name, self.task.stop.reason)
        finally:
            self.feed.close()
            self.finished.set()
            if beat is not None:
                beat.join(timeout=10)
                # a stopped or failed worker did not finish: no "done"
                if trained and not self.task.stop.is_set:
                    self._beat(done=True)
            coordinator.close()
            self.client.close()
        log.info("%s: done at step %d, loss %.4f", self.task.name, self.step, self.loss)
        return 0

    def _loop(self) -> None:
        sync = self.task.training.mode is ModeKind.SYNC
        self._buffers: dict[str, np.ndarray] | None = None
        self._pulled: int | None = None  # the step of _buffers when the last update brought them
        min_step = 0
        while not self.finished.is_set():
            self.task.stop.check()  # the safe point: between two steps
            try:
                min_step = self._step(min_step=min_step, sync=sync)
            except PsClientError as err:
                if divergence.refused_as_not_finite(err):
                    self._diverge(f"a ps refused its update: {err}")
                elif err.code not in RECOVERABLE and not isinstance(err, PsRestartedError):
                    raise
                if not self._recover(err):
                    return
                self._pulled = None
                min_step = 0  # the ps tier may have rolled back: take whatever step it is at
            if min_step == _DIVERGED:  # reported (onDivergence: rollback): wait for it
                if not self._recover("its step diverged"):
                    return
                self._pulled = None
                min_step = 0
            elif min_step < 0:
                return

    def _drain(self) -> bool:
        """The worker's training is over (the last step is reached): it says it is done and
        waits for the chief to record the job's outcome (the chief's stop). True when the ps
        tier was rolled back below the last step meanwhile (a ps was lost while the chief
        finished): training goes on. False once the chief says stop, or has not answered for
        `startupTimeoutSeconds` (the control plane ends the job)."""
        training = self.task.training
        self.drained, self.waiting = True, "the chief to record the job's outcome"
        while not self.finished.wait(training.heartbeatSeconds):
            self.task.stop.check()
            if time.monotonic() - self.last_heard > training.startupTimeoutSeconds:
                log.warning(
                    "%s: the chief has not answered for %.0f s since training ended; exiting",
                    self.task.name,
                    time.monotonic() - self.last_heard,
                )
                return False
            try:
                step = self.client.wait_ready(timeout=2.0)
            except (TimeoutError, PsClientError):
                continue
            if step < training.steps and not self.finished.is_set():
                log.warning(
                    "%s: the ps tier was rolled back to step %d: training again",
                    self.task.name,
                    step,
                )
                self.step, self.drained = step, False
                self.feed.reset()
                self._pulled = None
                return True
        return False

    def _diverge(self, what: str) -> None:
        """The loss, a gradient or an update is not finite at this step and batch: the job
        ends, or the worker reports it for a rollback (`divergence.on_worker`)."""
        at = self.position
        self.diverged = divergence.on_worker(
            self.task,
            what,
            step=self.step,
            batch=at.batch if at else -1,
            data_epoch=at.epoch if at else -1,
            epoch=self.client.epoch,
        )

    def _recover(self, err: PsClientError | str) -> bool:
        """Waits until every ps is ready again at one epoch (a newer one after a reported
        divergence); False if training ended meanwhile."""
        log.warning("%s: %s; waiting for the ps tier to be ready again", self.task.name, err)
        started = time.monotonic()
        diverged_at = int(self.diverged[divergence.DIVERGED_EPOCH]) if self.diverged else None
        self.waiting = "every ps to be ready again (a rollback)"
        self.client.incarnations = [0] * len(self.client.incarnations)
        while not self.finished.is_set():
            try:
                self.step = self.client.wait_ready(timeout=2.0)
            except (TimeoutError, PsClientError):
                if time.monotonic() - started > self.task.training.startupTimeoutSeconds:
                    raise
                continue
            if diverged_at is not None and self.client.epoch <= diverged_at:
                if time.monotonic() - started > self.task.training.startupTimeoutSeconds:
                    raise TimeoutError(
                        f"{self.task.name}: reported a divergence, and the chief did not roll "
                        f"the ps tier back within {self.task.training.startupTimeoutSeconds} s"
                    )
                self.task.stop.sleep(min(0.2, self.task.training.heartbeatSeconds))
                continue
            self.diverged = {}
            self.feed.reset()  # the queue starts over from the ps tier's positions
            seconds = time.monotonic() - started
            log.info(
                "%s: ps tier ready again at step %d after %.1f s",
                self.task.name,
                self.step,
                seconds,
            )
            return True
        return False

    def _leave(self) -> None:
        """Drains: gives the leases back over a channel of its own (the task's closed)."""
        self.feed.leave(self.task.coordinator(stop=stopping.Stop()))

    def _step(self, *, min_step: int, sync: bool) -> int:
        """One training step; returns the next pull's min_step, -1 when training is over, or
        `_DIVERGED` when it reported a divergence (onDivergence: rollback)."""
        training, task = self.task.training, self.task
        started = time.perf_counter()
        self.waiting = "a shard of the data from the chief's queue (Lease)"
        try:
            at = self.position = self.feed.batch()
        except TrainingOverError:
            return -1
        task.metrics.data_epoch.set(self.feed.epoch)
        if at is None:  # no shard now: the chief brings the ps tier up, or the epoch ends
            self.waiting, share = self.feed.waiting, not self.feed.hold  # (then an idle share)
            if sync and share:  # the step waits for every live worker: its share is nothing
                return self._push_nothing(None, min_step=min_step, sync=sync)
            if share and training.mode is ModeKind.BOUNDED_STALENESS:  # it holds nobody back
                self._push_nothing(None, min_step=0, sync=sync)
                self.feed.wait(min(0.05, training.heartbeatSeconds))
            else:  # back as soon as a shard is in
                self.feed.wait(min(0.25, training.heartbeatSeconds))
            return 0
        if at.skip:  # diverged before: the position moves past it, no gradient
            return self._push_nothing(at, min_step=min_step, sync=sync)
        self.waiting = f"batch {at.batch} of data epoch {at.epoch} from the dataset"
        with outcome.user_code("the dataset's train_batch", task=task.name):
            batch = self.plan.read(task.dataset, epoch=at.epoch, batch=at.batch)
        rows = _wanted_rows(batch, tables=task.tables, table_rows=self._table_rows)
        dense = task.dense_variables
        params: dict[str, Any]
        if self._pulled is not None:  # sync: the last update brought this step's values
            step, self._pulled = self._pulled, None
            params = dict(self._buffers or {})
        else:  # one Read per ps: the dense values and the batch's rows
            self.waiting = f"the parameters of step >= {min_step} from every ps (Read)"
            step, params = self.client.read(
                min_step=min_step, into=self._buffers, variables=dense, rows=rows
            )
            self._buffers = {name: params[name] for name in dense}
        self.step = step
        task.metrics.global_step.set(step)
        if step >= training.steps:
            return -1
        pulled = time.perf_counter()
        self.waiting = f"its gradients of step {step} (the model's loss, compiled on step 1)"
        with outcome.user_code("the model's loss", task=task.name):
            loss, grads, finite = self._grad(task.layout.unflatten(params), batch)
            named = {n: np.asarray(g) for n, g in task.layout.named(grads).items()}
        self.loss = float(loss)
        if not bool(finite):
            self._diverge(divergence.what_is_not_finite(self.loss, named))
            return _DIVERGED
        computed = time.perf_counter()
        # One Update per ps, rows included. Sync without tables: then the next step's values
        # (what its read would wait for). Otherwise the next step reads afresh, as TensorFlow's
        # workers do: values read right after one's own update miss the others' (staler).
        keep = sync and not rows
        self.waiting = (
            f"the other workers' gradients of step {step} (sync Update)"
            if sync
            else f"every ps to apply its update of step {step} (Update)"
        )
        next_step, values, replies = self.client.update(
            named,
            step=step,
            variables=dense,
            rows={v: (ids, named[v]) for v, ids in rows.items()},
            shard=at.shard,
            cursor=at.cursor,
            lease=at.lease,
            then_read=keep,
            min_step=step + 1 if keep else 0,
            into=self._buffers,
        )
        applied = self.feed.settle(replies, step=step)
        if keep and (applied or not refused_position(replies)):
            self._buffers, self._pulled = values, next_step
        pushed = time.perf_counter()
        task.metrics.loss.set(self.loss)
        self.times.add(
            pull=pulled - started,
            compute=computed - pulled,
            push=pushed - computed,
            examples=len(next(iter(batch.values()))) if batch else 0,
            step=step,
        )
        return _next_min_step(replies, step=step, sync=sync, steps=training.steps)

    def _push_nothing(self, at: Position | None, *, min_step: int, sync: bool) -> int:
        """A push with no gradient: a skipped batch's position (`at`), or, with no batch, this
        worker's share of a sync step (or, bounded staleness, a word that it holds nobody back)."""
        self.waiting = f"the ps tier's step >= {min_step} (Read)" if at else self.feed.waiting
        self._pulled = None
        steps = self.task.training.steps
        self.step, replies = _empty_push(self.client, at, min_step=min_step, steps=steps)
        if self.step >= steps:
            return -1
        if at is not None:
            self.feed.settle(replies, step=self.step)
        return _next_min_step(replies, step=self.step, sync=sync, steps=steps)


def _empty_push(
    client: Any, at: Position | None, *, min_step: int, steps: int
) -> tuple[int, list[Any]]:
    """Reads the step (from `min_step` on), then pushes no tensor at it: `at`'s position, or
    nothing at all (an idle worker). The step, and each ps's reply (none past the last step)."""
    step, _ = client.read(min_step=min_step, variables=[])
    if step >= steps:
        return step, []
    _, _, replies = client.update(
        {},
        step=step,
        variables=[],
        shard=at.shard if at else "",
        cursor=at.cursor if at else 0,
        lease=at.lease if at else 0,
        idle=at is None,
    )
    return step, replies


def _compile_short_batch(worker: Worker) -> None:
    """Compiles the step for each epoch's last, shorter batch before training (the first step
    compiles it for full ones), so that no step in the middle of the run pays for a compile."""
    task, plan = worker.task, worker.plan
    if plan.short_batch is None:
        return
    with outcome.user_code("the dataset's train_batch", task=task.name):
        batch = plan.read(task.dataset, epoch=0, batch=plan.short_batch)
    rows = _wanted_rows(batch, tables=task.tables, table_rows=worker._table_rows)
    _, params = worker.client.read(variables=task.dense_variables, rows=rows)
    with outcome.user_code("the model's loss", task=task.name):
        _, _, finite = worker._grad(task.layout.unflatten(params), batch)
        bool(finite)  # waits for it: the compile is done


def _next_min_step(replies: list[Any], *, step: int, sync: bool, steps: int) -> int:
    """The step the next read waits for after an update of `step`. Training is over once every
    ps has reached the last step: a ps behind (a push of a worker that died reached only the
    others) still takes batches, which the ps past it refuse as over."""
    if replies and min(r.step for r in replies) >= steps:
        return steps
    if refused_position(replies):  # it did not count: the step may wait for it
        return 0
    return step + 1 if sync else 0


def _wanted_rows(
    batch: dict[str, np.ndarray], *, tables: dict[str, str], table_rows: dict[str, int]
) -> dict[str, np.ndarray]:
    """The rows the batch uses per table, unique; remaps the batch's ids to positions in
    them. Padded (with the first row again, whose padding gradients are zero) to as many
    rows as the batch has ids or the table has rows, whichever is fewer: one shape per
    table for every batch, so the step compiles once, whatever the number of unique ids
    (a model with many tables would otherwise meet new shapes at nearly every step)."""
    wanted: dict[str, np.ndarray] = {}
    for variable, key in tables.items():
        ids = np.asarray(batch[key], dtype=np.int64)
        unique, inverse = np.unique(ids, return_inverse=True)
        size = max(min(ids.size, table_rows[variable]), unique.size)
        padded = np.full(size, unique[0] if unique.size else 0, np.int64)
        padded[: unique.size] = unique
        wanted[variable] = padded
        batch[key] = inverse.reshape(ids.shape)
    return wanted


def run(task: Task) -> int:
    return Worker(task).run()
