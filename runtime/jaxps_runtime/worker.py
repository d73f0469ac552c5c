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
from dataclasses import dataclass, field
from typing import Any

import grpc
import jax
import numpy as np

from jaxps_runtime.client import PsClientError, PsRestartedError
from jaxps_runtime.task import Task

log = logging.getLogger(__name__)


SPAN_KEYS = ("firstStepTime", "firstStep", "lastStepTime", "lastStep")
"""Heartbeat metrics a worker adds to its step split: the wall time and global step at the end
of its first warm step and of its last step (see :func:`overlap_steps_per_second`)."""


@dataclass
class StepTimes:
    """Seconds spent per step in each phase, summed after the first (compiling) step, and the
    span (wall time, global step) the warm steps covered."""

    pull: float = 0.0
    compute: float = 0.0
    push: float = 0.0
    steps: int = 0
    examples: int = 0
    started: float = field(default_factory=time.perf_counter)
    warm: bool = False
    span: list[float] = field(default_factory=list)

    def add(self, *, pull: float, compute: float, push: float, examples: int, step: int) -> None:
        now = time.time()
        if not self.warm:  # the first step compiles: leave it out
            self.warm = True
            self.started = time.perf_counter()
            self.span = [now, step, now, step]
            return
        self.pull += pull
        self.compute += compute
        self.push += push
        self.steps += 1
        self.examples += examples
        self.span[2:] = [now, step]

    def means(self) -> dict[str, float]:
        """The mean split of a step (seconds) and, once warm, the span (SPAN_KEYS)."""
        n = max(self.steps, 1)
        split = {"pull": self.pull / n, "compute": self.compute / n, "push": self.push / n}
        return {**split, **dict(zip(SPAN_KEYS, self.span, strict=False))}

    def examples_per_second(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.examples / elapsed if elapsed > 0 else 0.0


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


def overlap_steps_per_second(spans: list[tuple[float, float, float, float]]) -> float:
    """Global steps per second while every worker trained, from each worker's span (first warm
    step's wall time and global step, last step's wall time and global step).

    A worker that starts late (TensorFlow's non-chief sleeps 30 s when it finds the chief not
    ready yet) would otherwise count the others' solo steps as if they ran side by side. With
    no common window (one worker finished before another began) it is the whole span's rate.
    """
    if not spans:
        return 0.0
    start = max(spans, key=lambda s: s[0])
    end = min(spans, key=lambda s: s[2])
    t0, step0, t1, step1 = start[0], start[1], end[2], end[3]
    if t1 <= t0 or step1 <= step0:
        t0, step0 = min((s[0], s[1]) for s in spans)
        t1, step1 = max((s[2], s[3]) for s in spans)
    return (step1 - step0) / (t1 - t0) if t1 > t0 else 0.0


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
        self.times = StepTimes()
        # Batches of this worker's data shard used so far. Each push carries the cursor it
        # makes; the ps tier records it with the update (and in checkpoints), and a worker
        # (re)starting or recovering goes on from that record: after the last batch whose
        # gradient reached the ps, or from the restored checkpoint's position.
        self.cursor = 0
        self._grad = jax.jit(jax.value_and_grad(task.model.loss))
        self._table_rows = {
            v.name: v.shape[0] for v in task.placement.variables if v.name in task.tables
        }

    def _wanted_rows(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The rows the batch uses per table, unique; remaps the batch's ids to positions in
        them. Padded (with the first row again, whose padding gradients are zero) to as many
        rows as the batch has ids or the table has rows, whichever is fewer: one shape per
        table for every batch, so the step compiles once, whatever the number of unique ids
        (a model with many tables would otherwise meet new shapes at nearly every step)."""
        wanted: dict[str, np.ndarray] = {}
        for variable, key in self.task.tables.items():
            ids = np.asarray(batch[key], dtype=np.int64)
            unique, inverse = np.unique(ids, return_inverse=True)
            size = max(min(ids.size, self._table_rows[variable]), unique.size)
            padded = np.full(size, unique[0] if unique.size else 0, np.int64)
            padded[: unique.size] = unique
            wanted[variable] = padded
            batch[key] = inverse.reshape(ids.shape)
        return wanted

    def _heartbeats(self, coordinator: Any, *, every: float) -> None:
        while not self.finished.wait(every):
            self.task.metrics.examples_per_second.set(self.times.examples_per_second())
            state = coordinator.heartbeat(
                step=self.step,
                loss=self.loss,
                metrics=self.times.means(),
                examples_per_second=self.times.examples_per_second(),
            )
            if state is not None and state.stop:
                log.info("%s: the chief says training is over", self.task.name)
                self.finished.set()

    def run(self) -> int:
        training = self.task.training
        coordinator = self.task.coordinator()
        beat: threading.Thread | None = None
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
        finally:
            self.finished.set()
            if beat is not None:
                beat.join(timeout=10)
                if not self.task.stop.is_set:  # a stopped worker did not finish: no "done"
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
        sync = self.task.training.mode == "sync"
        self._buffers: dict[str, np.ndarray] | None = None
        self._pulled: int | None = None  # the step of _buffers when the last update brought them
        min_step = 0
        while not self.finished.is_set():
            self.task.stop.check()  # the safe point: between two steps
            try:
                min_step = self._step(min_step=min_step, sync=sync)
            except PsClientError as err:
                if err.code not in RECOVERABLE and not isinstance(err, PsRestartedError):
                    raise
                if not self._recover(err):
                    return
                self._pulled = None
                min_step = 0  # the ps tier may have rolled back: take whatever step it is at
            if min_step < 0:
                return

    def _recover(self, err: PsClientError) -> bool:
        """Waits until every ps is ready again at one epoch; False if training ended meanwhile."""
        log.warning("%s: %s; waiting for the ps tier to be ready again", self.task.name, err)
        started = time.monotonic()
        self.client.incarnations = [0] * len(self.client.incarnations)
        while not self.finished.is_set():
            try:
                self.step = self.client.wait_ready(timeout=2.0)
            except (TimeoutError, PsClientError):
                if time.monotonic() - started > self.task.training.startupTimeoutSeconds:
                    raise
                continue
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
        """One training step; returns the next pull's min_step, or -1 when training is over."""
        training, task = self.task.training, self.task
        dense = task.dense_variables
        started = time.perf_counter()
        batch = task.dataset.train_batch(
            worker=self.index,
            num_workers=self.num_workers,
            step=self.cursor,
            batch_size=training.batchSize,
        )
        rows = self._wanted_rows(batch)
        params: dict[str, Any]
        if self._pulled is not None:  # sync: the last update brought this step's values
            step, self._pulled = self._pulled, None
            params = dict(self._buffers or {})
        else:  # one Read per ps: the dense values and the batch's rows
            step, params = self.client.read(
                min_step=min_step, into=self._buffers, variables=dense, rows=rows
            )
            self._buffers = {name: params[name] for name in dense}
        self.step = step
        task.metrics.global_step.set(step)
        if step >= training.steps:
            return -1
        pulled = time.perf_counter()
        loss, grads = self._grad(task.layout.unflatten(params), batch)
        named = {n: np.asarray(g) for n, g in task.layout.named(grads).items()}
        self.loss = float(loss)
        computed = time.perf_counter()
        # One Update per ps, the embedding rows included. Sync without tables: the update,
        # then the values of the next step (exactly what the next read would wait for).
        # Otherwise the update alone: the next step reads the values (and its rows) afresh at
        # its start, as TensorFlow's workers do, because values read right after one's own
        # update miss the other workers' updates of the meantime (staler gradients; async
        # Adam visibly oscillates).
        keep = sync and not rows
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


def run(task: Task) -> int:
    return Worker(task).run()
