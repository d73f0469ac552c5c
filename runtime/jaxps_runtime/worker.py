"""The worker: pull, `jax.value_and_grad` under `jax.jit`, push; on its own shard of the data.

Between-graph replication as TensorFlow's workers do it, against the ps tier:
- dense variables are pulled whole (into buffers reused across steps); an embedding table is
  pulled by rows: only the unique ids of the batch, padded to a power of two so the jitted
  step compiles a few times only, and the batch's ids are remapped to positions in those rows;
- sync: the next pull waits for the step the ps tasks reach once enough workers have pushed;
  a refused (stale) push just moves on to the current step;
- async and bounded staleness: pull whatever is there (the ps holds a worker back that is too
  far ahead), push, repeat.
The worker stops when the global step reaches `steps` or the chief says stop. A background
thread heartbeats to the chief with the step, the loss and the per-step time split.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxps_runtime import placement
from jaxps_runtime.task import Task

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Seconds spent per step in each phase, summed after the first (compiling) step."""

    pull: float = 0.0
    compute: float = 0.0
    push: float = 0.0
    steps: int = 0
    examples: int = 0
    started: float = field(default_factory=time.perf_counter)
    warm: bool = False

    def add(self, *, pull: float, compute: float, push: float, examples: int) -> None:
        if not self.warm:  # the first step compiles: leave it out
            self.warm = True
            self.started = time.perf_counter()
            return
        self.pull += pull
        self.compute += compute
        self.push += push
        self.steps += 1
        self.examples += examples

    def means(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"pull": self.pull / n, "compute": self.compute / n, "push": self.push / n}

    def examples_per_second(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.examples / elapsed if elapsed > 0 else 0.0


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Worker:
    """One worker's training loop (also run by worker 0 when the job has no chief)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.index = task.spec.task.index
        self.num_workers = len(task.worker_names)
        self.client = task.ps_client()
        self.stop = threading.Event()
        self.step = 0
        self.loss = math.nan
        self.times = StepTimes()
        self._grad = jax.jit(jax.value_and_grad(task.model.loss))

    def _gather_rows(
        self, batch: dict[str, np.ndarray], params: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        """Pulls the rows the batch uses; returns the unique ids pulled per table."""
        wanted: dict[str, np.ndarray] = {}
        for variable, key in self.task.tables.items():
            ids = np.asarray(batch[key], dtype=np.int64)
            unique, inverse = np.unique(ids, return_inverse=True)
            padded = np.full(_bucket(unique.size), unique[0] if unique.size else 0, np.int64)
            padded[: unique.size] = unique
            wanted[variable] = padded
            batch[key] = inverse.reshape(ids.shape)
        if wanted:
            params.update(self.client.sparse_pull(wanted))
        return wanted

    def _heartbeats(self, coordinator: Any, *, every: float) -> None:
        while not self.stop.wait(every):
            self.task.metrics.examples_per_second.set(self.times.examples_per_second())
            state = coordinator.heartbeat(
                step=self.step,
                loss=self.loss,
                metrics=self.times.means(),
                examples_per_second=self.times.examples_per_second(),
            )
            if state is not None and state.stop:
                log.info("%s: the chief says training is over", self.task.name)
                self.stop.set()

    def run(self) -> int:
        training = self.task.training
        coordinator = self.task.coordinator()
        coordinator.register(timeout=training.startupTimeoutSeconds)
        self.step = self.client.wait_ready(timeout=training.startupTimeoutSeconds)
        log.info(
            "%s: ps ready at step %d (epoch %d); training %s, data shard %d of %d",
            self.task.name,
            self.step,
            self.client.epoch,
            training.mode,
            self.index,
            self.num_workers,
        )
        beat = threading.Thread(
            target=self._heartbeats,
            args=(coordinator,),
            kwargs={"every": training.heartbeatSeconds},
            daemon=True,
        )
        beat.start()
        try:
            self._loop()
        finally:
            self.stop.set()
            beat.join(timeout=10)
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
        training, task = self.task.training, self.task
        sync = training.mode == "sync"
        dense = task.dense_variables
        buffers: dict[str, np.ndarray] | None = None
        min_step = 0
        local = 0  # this worker's batches so far: its position in its data shard
        while not self.stop.is_set():
            started = time.perf_counter()
            step, buffers = self.client.pull(min_step=min_step, into=buffers, variables=dense)
            self.step = step
            task.metrics.global_step.set(step)
            if step >= training.steps:
                return
            batch = task.dataset.train_batch(
                worker=self.index,
                num_workers=self.num_workers,
                step=local,
                batch_size=training.batchSize,
            )
            params: dict[str, Any] = dict(buffers)
            rows = self._gather_rows(batch, params)
            pulled = time.perf_counter()
            loss, grads = self._grad(task.layout.unflatten(params), batch)
            named = placement.named_leaves(grads)[1]
            named = {n: np.asarray(g) for n, g in named.items()}
            self.loss = float(loss)
            computed = time.perf_counter()
            if rows:
                self.client.sparse_push({v: (ids, named[v]) for v, ids in rows.items()}, step=step)
            replies = self.client.push(named, step=step, variables=dense)
            pushed = time.perf_counter()
            local += 1
            task.metrics.loss.set(self.loss)
            self.times.add(
                pull=pulled - started,
                compute=computed - pulled,
                push=pushed - computed,
                examples=training.batchSize,
            )
            refused = [r.reason for r in replies if not r.accepted]
            if refused and log.isEnabledFor(logging.DEBUG):
                log.debug("%s: push at step %d refused: %s", task.name, step, refused[0])
            if sync:
                min_step = step + 1
            if any(r.step >= training.steps for r in replies) and not sync:
                min_step = training.steps


def run(task: Task) -> int:
    return Worker(task).run()
