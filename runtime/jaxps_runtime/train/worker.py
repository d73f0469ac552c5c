"""The worker: read, `jax.value_and_grad` under `jax.jit`, update; on its own shard of the data.

Between-graph replication as TensorFlow's workers do it, against the ps tier, one Read and one
Update per ps and step:
- dense variables are read whole (into buffers reused across steps); an embedding table is
  read by rows: only the unique ids of the batch, padded to one size per table so the jitted
  step compiles once, and the batch's ids are remapped to positions in those rows;
- sync: the update brings back the values of the next step (the ps replies once enough workers
  have pushed); a refused (stale) push just moves on to the current step;
- async and bounded staleness: read whatever is there (the ps holds a worker back that is too
  far ahead), update, repeat.
The worker stops when the global step reaches `steps` or the chief says stop, and exits with
`stopping.Stopped` between two steps (or from a wait) once the task is told to stop: then it
does not tell the chief it is done, so the chief drops it after `workerTimeoutSeconds` as it
does a dead worker. A background thread heartbeats to the chief with the step, the loss and
the per-step time split.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import grpc
import numpy as np

from jaxps_runtime.client.psclient import PsClientError, PsRestartedError
from jaxps_runtime.config.mode import ModeKind
from jaxps_runtime.train import divergence, outcome, timing
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
        self.num_workers = len(task.worker_names)
        self.client = task.ps_client()
        self.finished = threading.Event()  # the chief says training is over
        self.step = 0
        self.loss = math.nan
        self.times = timing.StepTimes()
        # Batches of this worker's data shard used so far. Each push carries the cursor it
        # makes; the ps tier records it with the update (and in checkpoints), and a worker
        # (re)starting or recovering goes on from that record: after the last batch whose
        # gradient reached the ps, or from the restored checkpoint's position.
        self.cursor = 0
        self._grad = divergence.finite_step(task.model.loss)
        self.waiting = ""  # what the worker waits for now: its heartbeats say it
        self.drained = False  # its training is over; it waits for the chief to end the job
        self.last_heard = time.monotonic()  # the chief's last answer to a heartbeat
        self.skip: set[int] = set()  # batches that diverged (onDivergence: rollback)
        self.diverged: dict[str, float] = {}  # the report of a divergence not rolled back yet
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
            self.cursor = self.client.cursors.get(self.task.name, 0)
            log.info(
                "%s: ps ready at step %d (epoch %d); training %s, data shard %d of %d from "
                "batch %d",
                self.task.name,
                self.step,
                self.client.epoch,
                training.mode,
                self.index,
                self.num_workers,
                self.cursor,
            )
            self._loop()
            while self._drain():
                self._loop()
            trained = True
        finally:
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
                self.cursor = self.client.cursors.get(self.task.name, 0)
                self._pulled = None
                return True
        return False

    def _diverge(self, what: str) -> None:
        """The loss, a gradient or an update is not finite at this step and batch. With
        `onDivergence: fail`, the job ends (`outcome.DivergedError`); with `rollback`, the
        worker reports it to the chief (heartbeats), skips this batch from now on, and returns
        to wait for the ps tier's rollback (`_recover`)."""
        training, task = self.task.training, self.task
        where = f"at global step {self.step} (batch {self.cursor} of its data shard)"
        if training.onDivergence != "rollback":
            raise outcome.DivergedError(
                f"{task.name}: {what} {where}; lower the learning rate or set "
                "training.onDivergence: rollback"
            )
        log.error("%s: %s %s: reporting it for a rollback", task.name, what, where)
        self.skip.add(self.cursor)
        self.diverged = divergence.report(
            step=self.step, batch=self.cursor, epoch=self.client.epoch
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
            cursor = self.client.cursors.get(self.task.name, 0)
            log.info(
                "%s: ps tier ready again at step %d (epoch %d) after %.1f s; data from batch %d%s",
                self.task.name,
                self.step,
                self.client.epoch,
                time.monotonic() - started,
                cursor,
                f" (the checkpoint's: {self.cursor - cursor} batches again)"
                if cursor < self.cursor
                else "",
            )
            self.cursor = cursor
            return True
        return False

    def _step(self, *, min_step: int, sync: bool) -> int:
        """One training step; returns the next pull's min_step, -1 when training is over, or
        `_DIVERGED` when it reported a divergence (onDivergence: rollback)."""
        training, task = self.task.training, self.task
        dense = task.dense_variables
        started = time.perf_counter()
        while self.cursor in self.skip:  # a batch that diverged (onDivergence: rollback)
            self.cursor += 1
        self.waiting = f"its batch {self.cursor} from the dataset (train_batch)"
        with outcome.user_code("the dataset's train_batch", task=task.name):
            batch = task.dataset.train_batch(
                worker=self.index,
                num_workers=self.num_workers,
                step=self.cursor,
                batch_size=training.batchSize,
            )
        rows = _wanted_rows(batch, tables=task.tables, table_rows=self._table_rows)
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
            cursor=self.cursor + 1,
            then_read=keep,
            min_step=step + 1 if keep else 0,
            into=self._buffers,
        )
        if keep:
            self._buffers, self._pulled = values, next_step
        pushed = time.perf_counter()
        self.cursor += 1
        task.metrics.loss.set(self.loss)
        self.times.add(
            pull=pulled - started,
            compute=computed - pulled,
            push=pushed - computed,
            examples=training.batchSize,
            step=step,
        )
        refused = [r.reason for r in replies if not r.accepted]
        if refused and log.isEnabledFor(logging.DEBUG):
            log.debug("%s: push at step %d refused: %s", task.name, step, refused[0])
        if sync:
            return step + 1
        if any(r.step >= training.steps for r in replies):
            return training.steps
        return 0


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
