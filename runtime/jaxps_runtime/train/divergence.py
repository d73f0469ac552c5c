"""A divergence, both ways: how a worker finds that its step is not finite, and the report it
heartbeats to the chief with `training.onDivergence: rollback`, which the chief reads
(`reported`) to roll the ps tier back once per report of its current epoch."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxps_runtime.client.psclient import PsClientError
from jaxps_runtime.train import outcome
from jaxps_runtime.train.coordinator import Member
from jaxps_runtime.train.task import Task
from jaxps_runtime.wire import terms

log = logging.getLogger(__name__)

DIVERGED_STEP, DIVERGED_BATCH, DIVERGED_EPOCH = "divergedStep", "divergedBatch", "divergedEpoch"
DIVERGED_DATA_EPOCH = "divergedDataEpoch"
"""Heartbeat metrics of a worker that diverged with `training.onDivergence: rollback`: the
global step, its batch (data cursor) and the epoch it diverged at; the chief rolls back once
per report of its current epoch."""


def finite_step(loss: Any) -> Any:
    """`jax.value_and_grad(loss)` that also says whether the loss and every gradient are
    finite: one boolean reduced inside the same compiled step (no host pass over the grads)."""
    value_and_grad = jax.value_and_grad(loss)

    def step(params: Any, batch: Any) -> tuple[Any, Any, Any]:
        value, grads = value_and_grad(params, batch)
        finite = jnp.isfinite(value)
        for leaf in jax.tree_util.tree_leaves(grads):
            finite = finite & jnp.all(jnp.isfinite(leaf))
        return value, grads, finite

    return jax.jit(step)


def refused_as_not_finite(err: PsClientError) -> bool:
    """Whether a ps refused an update because its gradient or its result was not finite (the
    reason it sends with the refusal, on gRPC and on the bulk path alike)."""
    return err.reason in (terms.NONFINITE_GRADIENT, terms.NONFINITE_UPDATE)


def what_is_not_finite(loss: float, grads: dict[str, np.ndarray]) -> str:
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    name = next((n for n, g in grads.items() if not np.isfinite(g).all()), "?")
    return f"the gradient of {name} is not finite (the loss is {loss:.6g})"


def on_worker(
    task: Task, what: str, *, step: int, batch: int, data_epoch: int, epoch: int
) -> dict[str, float]:
    """A worker's loss, gradient or update is not finite at `step`, on `batch` of `data_epoch`.
    With `onDivergence: fail` the job ends (`outcome.DivergedError`); with `rollback` the
    worker's report (its heartbeats carry it): the chief rolls back and the queue skips that
    batch from then on."""
    where = f"at global step {step} (batch {batch} of data epoch {data_epoch})"
    if task.training.onDivergence != "rollback":
        raise outcome.DivergedError(
            f"{task.name}: {what} {where}; lower the learning rate or set "
            "training.onDivergence: rollback"
        )
    log.error("%s: %s %s: reporting it for a rollback", task.name, what, where)
    return report(step=step, batch=batch, epoch=epoch, data_epoch=data_epoch)


def report(*, step: int, batch: int, epoch: int, data_epoch: int) -> dict[str, float]:
    """The heartbeat metrics of a divergence at `step` on `batch` of `data_epoch`, at (cluster)
    `epoch`."""
    return {
        DIVERGED_STEP: float(step),
        DIVERGED_BATCH: float(batch),
        DIVERGED_EPOCH: float(epoch),
        DIVERGED_DATA_EPOCH: float(data_epoch),
    }


def diverged_batch(
    members: Iterable[Member], *, workers: Collection[str], epoch: int
) -> tuple[int, int] | None:
    """(data epoch, batch) of a worker's report of a divergence at `epoch`; None without."""
    for m in members:
        if m.task in workers and int(m.metrics.get(DIVERGED_EPOCH, -1)) == epoch:
            return int(m.metrics.get(DIVERGED_DATA_EPOCH, -1)), int(
                m.metrics.get(DIVERGED_BATCH, -1)
            )
    return None


def reported(members: Iterable[Member], *, workers: Collection[str], epoch: int) -> str | None:
    """A worker's report of a divergence at `epoch`, as the reason of the rollback it asks
    for; None without one."""
    for m in members:
        if m.task not in workers or DIVERGED_EPOCH not in m.metrics:
            continue
        if int(m.metrics[DIVERGED_EPOCH]) == epoch:
            return (
                f"{m.task} diverged at global step {int(m.metrics.get(DIVERGED_STEP, 0))} "
                f"(batch {int(m.metrics.get(DIVERGED_BATCH, 0))} of data epoch "
                f"{int(m.metrics.get(DIVERGED_DATA_EPOCH, 0))})"
            )
    return None


# A finite loss that grew this much over the job, by both measures, diverged: a model whose
# cross-entropy went from 2.3 to 775,477 under a learning rate of 1e6 is no model that trained.
# Both, so that a converged model's noisy batch losses (0.05 then 0.6) never count.
GROWTH_FACTOR = 10.0
GROWTH_MARGIN = 1.0


FIRST_LOSS, FIRST_LOSS_STEP = "firstLoss", "firstLossStep"
"""Heartbeat metrics of a worker: the loss of its first step, and that step."""


def first_loss_report(*, step: int, loss: float) -> dict[str, float]:
    """A worker's heartbeat metrics of its first finite loss."""
    return {FIRST_LOSS: loss, FIRST_LOSS_STEP: float(step)}


def first_loss(members: Iterable[Member], *, workers: Collection[str]) -> tuple[int, float] | None:
    """The job's first loss: of the earliest first step any worker reported (step, loss)."""
    firsts = [
        (int(m.metrics[FIRST_LOSS_STEP]), m.metrics[FIRST_LOSS])
        for m in members
        if m.task in workers and FIRST_LOSS in m.metrics and FIRST_LOSS_STEP in m.metrics
    ]
    return min(firsts, default=None)


def grown(first: tuple[int, float] | None, *, step: int, loss: float) -> str | None:
    """Why the workers' mean loss at `step` says the training diverged although every value
    stayed finite, against the job's first loss (`first`: its step and value), or None."""
    if first is None or not math.isfinite(loss):
        return None
    first_step, first_loss = first
    if loss <= GROWTH_FACTOR * abs(first_loss) or loss - first_loss <= GROWTH_MARGIN:
        return None
    return (
        f"the workers' mean loss grew from {first_loss:.4g} (step {first_step}) to {loss:.4g} "
        f"(step {step}), more than {GROWTH_FACTOR:g} times, though every value stayed finite: "
        "the training diverged; lower the learning rate"
    )
