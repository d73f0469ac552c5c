"""The built-in training loop: read, `jax.value_and_grad` under `jax.jit`, update, over a model's
`loss`, on a `train.session.Session` like any user's own loop (`training.program`).

Between-graph replication as TensorFlow's workers do it, one Read and one Update per ps and step,
on the batches of the shards the chief's queue leases the worker (the session's `next_batch`):
- dense variables are read whole (into buffers reused across steps); an embedding table is
  read by rows: only the unique ids of the batch, padded to one size per table so the jitted
  step compiles once, and the batch's ids are remapped to positions in those rows;
- sync: the update brings back the values of the next step; async and bounded staleness: read
  whatever is there (the ps holds a worker back that is too far ahead), update, repeat.
Recovery, draining, heartbeats and exactly-once are the session's.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import numpy as np

from jaxps_runtime.model import builtin as models
from jaxps_runtime.train import divergence, outcome
from jaxps_runtime.train.session import Session
from jaxps_runtime.train.task import Task
from jaxps_runtime.wire import tables as tables_of

log = logging.getLogger(__name__)


class Worker:
    """The built-in loop of one worker (also run by worker 0 when the job has no chief)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self._grad = divergence.finite_step(task.model.loss)
        self._table_rows = {
            v.name: v.shape[0] for v in task.placement.variables if v.name in task.tables
        }

    def run(self) -> int:
        task = self.task
        with Session(task) as session:
            compiled = False
            while not session.should_stop():
                if not compiled:  # once the ps are ready
                    self._compile_short_batch(session)
                    compiled = True
                batch = session.next_batch()
                if batch is None:
                    continue
                problem = models.label_problem(task.model, batch)
                if problem is not None:
                    raise outcome.InvalidDataError(
                        f"{task.name}: dataset {task.training.dataset.name!r}, batch at step "
                        f"{session.global_step}: {problem}"
                    )
                rows, counts = _wanted_rows(
                    batch, tables=task.tables, table_rows=self._table_rows, dynamic=task.dynamic
                )
                params = session.pull(rows=rows)
                if session.over:
                    continue
                with outcome.user_code("the model's loss", task=task.name):
                    loss, grads, finite = self._grad(task.layout.unflatten(params), batch)
                    named = {n: np.asarray(g) for n, g in task.layout.named(grads).items()}
                session.push(
                    named,
                    rows=_pushed_rows(rows, named, counts),
                    counts={v: c[c > 0] for v, c in counts.items()},
                    loss=float(loss),
                    finite=bool(finite),
                )
        return 0

    def _compile_short_batch(self, session: Session) -> None:
        """Compiles the step for each epoch's last, shorter batch before training (the first
        step compiles the full one): a compile mid-run would stall every sync step."""
        task, plan = self.task, session.plan
        if plan.short_batch is None:
            return
        with outcome.user_code("the dataset's train_batch", task=task.name):
            batch = plan.read(task.dataset, epoch=0, batch=plan.short_batch)
        rows, _ = _wanted_rows(
            batch, tables=task.tables, table_rows=self._table_rows, dynamic=task.dynamic
        )
        _, params = session.client.read(variables=task.dense_variables, rows=rows)
        with outcome.user_code("the model's loss", task=task.name):
            _, _, finite = self._grad(task.layout.unflatten(params), batch)
            bool(finite)  # waits for it: the compile is done


def _wanted_rows(
    batch: dict[str, np.ndarray],
    *,
    tables: dict[str, str],
    table_rows: dict[str, int],
    dynamic: Collection[str] = (),
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The rows the batch uses per table, unique; remaps the batch's ids to positions in
    them. Padded (with the first row again, whose padding gradients are zero) to as many
    rows as the batch has ids or the table has rows, whichever is fewer: one shape per
    table for every batch, so the step compiles once, whatever the number of unique ids
    (a model with many tables would otherwise meet new shapes at nearly every step). And,
    per `dynamic` table (ids any int64), each row's occurrences in the batch (0: padding),
    what its admission counts."""
    wanted: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for variable, key in tables.items():
        ids = np.asarray(batch[key], dtype=np.int64)
        unique, seen, inverse = tables_of.dedup(ids)
        size = max(min(ids.size, table_rows[variable]), unique.size)
        padded = np.full(size, unique[0] if unique.size else 0, np.int64)
        padded[: unique.size] = unique
        wanted[variable] = padded
        batch[key] = inverse.reshape(ids.shape)
        if variable in dynamic:
            counts[variable] = np.zeros(size, np.int64)
            counts[variable][: unique.size] = seen
    return wanted, counts


def _pushed_rows(
    rows: dict[str, np.ndarray], named: dict[str, np.ndarray], counts: dict[str, np.ndarray]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each table's (row ids, gradient rows) to push: a dynamic table's without the padding
    (rows its batch has no id of: count 0), which would only be summed away on the ps."""
    out = {}
    for variable, ids in rows.items():
        grads = named[variable]
        real = counts[variable] > 0 if variable in counts else slice(None)
        out[variable] = (ids[real], grads[real])
    return out


def run(task: Task) -> int:
    return Worker(task).run()
