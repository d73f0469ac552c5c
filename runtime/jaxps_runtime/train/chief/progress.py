"""What the chief publishes of training as it goes: the global step, the workers' mean loss
and examples per second (its metrics), and one TensorBoard point per step with steps and
examples per second and the pull/compute/push split of a step (`summaries`, with
`training.tensorboard`)."""

from __future__ import annotations

import math

from jaxps_runtime.train import summaries
from jaxps_runtime.train.coordinator import Member, Membership
from jaxps_runtime.train.task import Task


class Progress:
    """The chief's published progress. Not thread-safe: the chief's main thread only. Its
    TensorBoard writer's thread starts with it; `close` ends it."""

    def __init__(self, task: Task, *, membership: Membership) -> None:
        self.metrics = task.metrics
        self.membership = membership
        self.every = task.training.summaryEverySteps
        self.tensorboard = summaries.Writer(
            task.training.tensorboard, run=summaries.TRAIN, task=task.name
        )
        self._recorded: int | None = None  # the step of the last TensorBoard point

    def restarted(self, *, step: int, rolled_back: bool) -> None:
        """Training (re)starts at `step`; after a rollback (or a fresh start) the points past
        it are void."""
        if rolled_back:
            self.tensorboard.restarted(step=step)
        self._recorded = step  # the next point once training moves on from here

    def update(self, step: int) -> float:
        """Publishes the global step, the workers' mean loss (returned) and their examples per
        second."""
        self.membership.step = step
        self.metrics.global_step.set(step)
        loss = self.membership.mean_loss()
        if not math.isnan(loss):
            self.metrics.loss.set(loss)
        self.metrics.examples_per_second.set(sum(m.examples_per_second for m in self._workers()))
        return loss

    def due(self, step: int) -> bool:
        """Whether the step crossed a multiple of `summaryEverySteps` since the last point."""
        last = self._recorded if self._recorded is not None else 0
        return step > last and step // self.every > last // self.every

    def record(self, *, step: int, loss: float, rate: float) -> None:
        """One log tick's TensorBoard scalars (`summaries`), with the global step; none while
        the step stands still (compiling, waiting for a worker): one point per step."""
        if step == self._recorded:
            return
        self._recorded = step
        workers = self._workers()
        values = {
            summaries.STEPS_PER_SECOND: rate,
            summaries.EXAMPLES_PER_SECOND: sum(m.examples_per_second for m in workers),
            **summaries.step_seconds(_mean_split(workers)),
        }
        if not math.isnan(loss):  # no loss before the first step
            values[summaries.LOSS] = loss
        self.tensorboard.scalars(values, step=step)

    def close(self) -> None:
        self.tensorboard.close()

    def _workers(self) -> list[Member]:
        return [m for m in self.membership.members() if m.task in self.membership.workers]


def rate(step: int, last_step: int, seconds: float) -> float:
    """Global steps per second over a window; a rollback moves the step back: no negative
    rate for the window it spans."""
    return max(step - last_step, 0) / seconds if seconds > 0 else 0.0


def _mean_split(members: list[Member]) -> dict[str, float]:
    """The mean {pull, compute, push} seconds of a step over the workers that timed one (until
    its first warm step, a worker reports 0 s for each)."""
    phases = ("pull", "compute", "push")
    timed = [m.metrics for m in members if sum(m.metrics.get(p, 0.0) for p in phases) > 0]
    return {p: sum(t.get(p, 0.0) for t in timed) / len(timed) for p in phases} if timed else {}
