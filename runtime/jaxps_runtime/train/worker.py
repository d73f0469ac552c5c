"""The worker: read, `jax.value_and_grad` under `jax.jit`, update; on its own shard of the data.

Between-graph replication as TensorFlow's workers do it, against the ps tier, one Read and one
Update per ps and step, on the batches of the shards the chief's queue leases it (`feed`): each
push names its batch (shard, position, lease) and every ps applies a batch once (`ps.positions`),
so every record is applied once per data epoch however workers come, go or die:
- dense variables are read whole (into buffers reused across steps); an embedding table is
  read by rows: only the unique ids of the batch, padded to one size per table so the jitted
  step compiles once, and the batch's ids are remapped to positions in those rows;
- sync: the update brings back the values of the next step (the ps replies once enough workers
  have pushed); a refused (stale) push just moves on to the current step;
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
from jaxps_runtime.train.feed import Feed, Position, TrainingOverError
from jaxps_runtime.train.task import Task
from jaxps_runtime.wire import terms

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
_DONE_WORDS = frozenset({"", terms.APPLIED, "duplicate"})  # the batch is in on that ps
_LOST_WORDS = frozenset({terms.REVOKED, terms.GAP})  # the lease is someone else's now


class Worker:
    """One worker's training loop (also run by worker 0 when the job has no chief)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.index = task.spec.task.index
        self.client = task.ps_client()
        self.plan = ShardPlan.of(
            task.dataset, batch_size=task.training.batchSize, seed=task.training.seed
        )
        self.feed: Feed | None = None
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
        self._first_applied = False  # logged once: when a new worker starts to count
        self._table_rows = {
            v.name: v.shape[0] for v in task.placement.variables if v.name in task.tables
        }

    def _heartbeats(self, coordinator: Any, *, every: float) -> None:
        while not self.finished.wait(every):
            self.task.metrics.examples_per_second.set(self.times.examples_per_second())
            state = coordinator.heartbeat(
                step=self.step,
                loss=self.loss,
                done=self.drained,
                metrics={**self.times.means(), **self.diverged},
                examples_per_second=self.times.examples_per_second(),
                waiting=self.waiting,
            )
            if state is not None:
                self.last_heard = time.monotonic()
            if state is not None and state.stop:
                log.info("%s: the chief says training is over", self.task.name)
                self.finished.set()

    def run(self) -> int:
        training = self.task.training
        coordinator = self.task.coordinator()
        beat: threading.Thread | None = None
        trained = False
        try:
            coordinator.register(timeout=training.startupTimeoutSeconds)
            # Heartbeats from registration on: a worker waiting for the ps is alive, however
            # long the chief takes to initialise them.
            beat = threading.Thread(
                target=self._heartbeats,
                args=(coordinator,),
                kwargs={"every": training.heartbeatSeconds},
                daemon=True,
            )
            beat.start()
            self.waiting = "every ps to be ready (the chief initialises or restores them)"
            self.step = self.client.wait_ready(timeout=training.startupTimeoutSeconds)
            self.feed = Feed(coordinator, name=self.task.name)
            log.info(
                "%s: ps ready at step %d (epoch %d); training %s on the shards the chief "
                "leases (%s)",
                self.task.name,
                self.step,
                self.client.epoch,
                training.mode,
                _describe(self.plan),
            )
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
            if self.feed is not None:
                self.feed.close()
            self.finished.set()
            if beat is not None:
                beat.join(timeout=10)
                # a stopped or failed worker did not finish: no "done"
                if trained and not self.task.stop.is_set:
                    coordinator.heartbeat(
                        step=self.step,
                        loss=self.loss,
                        done=True,
                        metrics=self.times.means(),
                        examples_per_second=self.times.examples_per_second(),
                    )
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
                if self.feed is not None:
                    self.feed.reset()
                self._pulled = None
                return True
        return False

    def _diverge(self, what: str) -> None:
        """The loss, a gradient or an update is not finite at this step and batch. With
        `onDivergence: fail`, the job ends (`outcome.DivergedError`); with `rollback`, the
        worker reports it to the chief (heartbeats), skips this batch from now on, and returns
        to wait for the ps tier's rollback (`_recover`)."""
        training, task = self.task.training, self.task
        at = self.position
        batch, data_epoch = (at.batch, at.epoch) if at is not None else (-1, -1)
        where = f"at global step {self.step} (batch {batch} of data epoch {data_epoch})"
        if training.onDivergence != "rollback":
            raise outcome.DivergedError(
                f"{task.name}: {what} {where}; lower the learning rate or set "
                "training.onDivergence: rollback"
            )
        log.error("%s: %s %s: reporting it for a rollback", task.name, what, where)
        self.diverged = divergence.report(
            step=self.step, batch=batch, epoch=self.client.epoch, data_epoch=data_epoch
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
            if self.feed is not None:
                self.feed.reset()  # the queue starts over from the ps tier's positions
            log.info(
                "%s: ps tier ready again at step %d (epoch %d) after %.1f s",
                self.task.name,
                self.step,
                self.client.epoch,
                time.monotonic() - started,
            )
            return True
        return False

    def _leave(self) -> None:
        """Drains: the last push is in (`stopping` lets it finish); the leases go back to the
        queue from where they got, over a channel of its own (the task's closed on the stop)."""
        if self.feed is None:
            return
        coordinator = self.task.coordinator(stop=stopping.Stop())
        try:
            self.feed.leave(coordinator)
        finally:
            coordinator.close()

    def _step(self, *, min_step: int, sync: bool) -> int:
        """One training step; returns the next pull's min_step, -1 when training is over, or
        `_DIVERGED` when it reported a divergence (onDivergence: rollback)."""
        training, task = self.task.training, self.task
        assert self.feed is not None
        started = time.perf_counter()
        self.waiting = "a shard of the data from the chief's queue (Lease)"
        try:
            at = self.position = self.feed.batch()
        except TrainingOverError:
            return -1
        task.metrics.data_epoch.set(self.feed.epoch)
        if at is None:
            return self._idle(min_step=min_step, sync=sync)
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
        # One Update per ps, the embedding rows included. Sync without tables: the update,
        # then the values of the next step (exactly what the next read would wait for).
        # Otherwise the update alone: the next step reads the values (and its rows) afresh at
        # its start, as TensorFlow's workers do, because values read right after one's own
        # update miss the other workers' updates of the meantime (staler gradients; async
        # Adam visibly oscillates).
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
        applied = self._applied(replies, at)
        if keep and (applied or not _refused_position(replies)):
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
        return self._next_min_step(replies, step=step, sync=sync)

    def _applied(self, replies: list[Any], at: Position) -> bool:
        """Moves the feed on when every ps has the batch in (applied now or before); drops the
        lease when a ps says it is someone else's. False: the batch is pushed again (a sync
        step closed without it, or another push of it was in flight)."""
        assert self.feed is not None
        words = {terms.refusal_word(r.reason) if not r.accepted else "" for r in replies}
        if words <= _DONE_WORDS:
            self.feed.applied()
            if not self._first_applied:
                self._first_applied = True
                log.info(
                    "%s: its first gradient is applied (step %d, batch %d of data epoch %d)",
                    self.task.name,
                    self.step,
                    at.batch,
                    at.epoch,
                )
            return True
        if words & _LOST_WORDS:
            self.feed.lost()
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s: batch %d again: %s", self.task.name, at.batch, sorted(words))
        return False

    def _next_min_step(self, replies: list[Any], *, step: int, sync: bool) -> int:
        if any(r.step >= self.task.training.steps for r in replies):
            return self.task.training.steps
        if _refused_position(replies):  # it did not count: the step may wait for it
            return 0
        return step + 1 if sync else 0

    def _push_nothing(self, at: Position | None, *, min_step: int, sync: bool) -> int:
        """A push with no gradient: a skipped batch's position (`at`), or, with no batch, sync's
        share of the step (the step waits for every live worker)."""
        self.waiting = f"the ps tier's step >= {min_step} (Read)"
        step, _ = self.client.read(min_step=min_step, variables=[])
        self.step = step
        if step >= self.task.training.steps:
            return -1
        _, _, replies = self.client.update(
            {},
            step=step,
            variables=[],
            shard=at.shard if at else "",
            cursor=at.cursor if at else 0,
            lease=at.lease if at else 0,
        )
        if at is not None:
            self._applied(replies, at)
        self._pulled = None
        return self._next_min_step(replies, step=step, sync=sync)

    def _idle(self, *, min_step: int, sync: bool) -> int:
        """No shard for this worker now (the data epoch ends while others finish theirs)."""
        assert self.feed is not None
        self.waiting = self.feed.waiting
        if sync:
            return self._push_nothing(None, min_step=min_step, sync=sync)
        self.task.stop.sleep(min(0.05, self.task.training.heartbeatSeconds))
        return 0


def _refused_position(replies: list[Any]) -> bool:
    """A ps refused the push for its data position, not as applied: it did not count there."""
    return any(
        not r.accepted and terms.refusal_word(r.reason) in _REFUSED_POSITION for r in replies
    )


_REFUSED_POSITION = frozenset({terms.REVOKED, terms.GAP, terms.BUSY})


def _describe(plan: ShardPlan) -> str:
    if plan.shards is None:
        return f"a stream: shards of {plan.shard_batches} batches of {plan.batch_size}"
    return (
        f"{plan.examples} examples a data epoch, {plan.shards} shards of {plan.shard_batches} "
        f"batches of {plan.batch_size}"
    )


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
