"""A worker's training session: what TensorFlow's `MonitoredTrainingSession` gives a worker's
own loop, over the ps tier. The built-in loop over a model's `loss` (`train.worker`) is one user
of it; a job's `training.program` (`train.program`) another.

    with Session(task) as session:
        while not session.should_stop():        # first: registers, waits for every ps; then
                                                # the last step, the chief's stop, a drain
            batch = session.next_batch()        # the job's data, every record once an epoch
            if batch is None:
                continue
            values = session.pull()             # {variable: array} at the global step
            grads = ...                         # the user's own computation
            session.push(grads, loss=loss)      # each ps's optimizer applies it

What the session does for the loop:
- the chief initialises or restores the ps tier while the session waits (its first
  `should_stop`);
- `next_batch` reads the batches of the shards the chief's queue leases this worker (`feed`):
  each push names its batch and every ps applies a batch once (`ps.positions`); with no shard
  at an epoch's end a sync worker pushes its idle share and an async one waits, inside;
- sync: `push` brings back the next step's values, which the next `pull` returns without a
  round trip; async and bounded staleness: `pull` reads whatever is there;
- a lost ps, a rollback or a restarted chief: the session waits until the ps tier is ready
  again and goes on at the step it is at; the loop sees at most a repeated step (`push`
  returns False: that batch again);
- a loss or gradient that is not finite ends the job (`Diverged`) or is reported for a rollback
  (`training.onDivergence`);
- SIGTERM (scaled down, suspended, preempted): `should_stop` raises `stopping.Stopped` between
  two steps; leaving the `with` block the session gives its leases back, leaves the job and the
  process exits 0;
- a heartbeat thread tells the chief the step, the loss, the per-step time split and what the
  session waits for.
Not thread-safe: one loop per session.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Collection, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from jaxps_runtime.client import placement
from jaxps_runtime.client.psclient import PsClientError
from jaxps_runtime.config.mode import ModeKind
from jaxps_runtime.data.arrays import Batch
from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.process import stopping
from jaxps_runtime.train import divergence, outcome
from jaxps_runtime.train.feed import Feed, Position, TrainingOverError, refused_position
from jaxps_runtime.train.link import Link
from jaxps_runtime.train.task import Task

log = logging.getLogger(__name__)


Rows = Mapping[str, tuple[np.ndarray, np.ndarray]]  # {table: (row ids, gradient rows)}


# What a worker's heartbeats say it waits for once a call of the session returned: the chief's
# Stalled message then points at the worker's own code, not at the call before.
IN_OWN_CODE = (
    "nothing of jaxps: it was last in its own step's code (the model's loss and gradients, "
    "or its training.program between two calls of its session)"
)


class Session:
    """One worker's session (also worker 0's when the job has no chief). `global_step`: the step
    of the last pull or push; `over`: the last step is reached."""

    def __init__(self, task: Task) -> None:
        self.task = task
        training = task.training
        self.plan = ShardPlan.of(task.dataset, batch_size=training.batchSize, seed=training.seed)
        coordinator = task.coordinator()
        self.feed = Feed(coordinator, name=task.name)
        self.link = Link(task, coordinator=coordinator, feed=self.feed)
        self.client = self.link.client
        self._sync = training.mode is ModeKind.SYNC
        self.steps = training.steps
        self._started = False
        self.trained = False  # `should_stop` said training is over
        self._over = False  # the last step is reached: `should_stop` drains
        self._min_step = 0  # the step the next pull waits for
        self._buffers: dict[str, np.ndarray] | None = None  # dense values, reused across pulls
        self._pulled: int | None = None  # sync: the step of `_buffers` the last push brought
        self._void = False  # the ps tier was recovered since this step's batch: do not push it
        self._marks: list[float] = []  # this step's (started, pulled) times
        self._examples = 0

    @property
    def global_step(self) -> int:
        return self.link.step

    @property
    def loss(self) -> float:
        return self.link.loss

    @property
    def over(self) -> bool:
        return self._over

    # --- the session's life ---------------------------------------------------------------------

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        """Trained to the end: tells the chief it is done. Told to stop (SIGTERM): drains (gives
        its leases back, leaves the job) and ends quietly, the process exits 0."""
        drained = False
        try:
            if isinstance(err, stopping.Stopped):
                self.link.finished.set()
                self.feed.leave(self.task.coordinator(stop=stopping.Stop()))
                drained = self.task.stop.exit_code == 128 + signal.SIGTERM
                if drained:
                    log.info("%s: drained on %s: exit 0", self.task.name, self.task.stop.reason)
        finally:
            self.feed.close()
            self.link.finished.set()
            if self.link.beats is not None:
                self.link.beats.join(timeout=10)
                # a stopped or failed worker did not finish: no "done"
                if err is None and self.trained and not self.task.stop.is_set:
                    self.link.beat(done=True)
            self.link.coordinator.close()
            self.client.close()
        log.info("%s: done at step %d, loss %.4f", self.task.name, self.link.step, self.link.loss)
        return drained

    def should_stop(self) -> bool:
        """True once training is over: the last step is reached and the chief has recorded the
        job's outcome (or said stop). Raises `stopping.Stopped` when told to stop: the safe
        point, between two steps. Training goes on (False) if the ps tier was rolled back
        below the last step while the session waited for the chief."""
        self.task.stop.check()
        if not self._started:
            self._started = True
            self.link.start(self.plan)
        if self.link.finished.is_set():
            self.trained = True
            return True
        if not self._over:
            return False
        if self.link.drain():
            self._pulled, self._min_step = None, 0
            self._over = False
            return False
        self.trained = True
        return True

    # --- the loop's calls -----------------------------------------------------------------------

    def next_batch(self) -> Batch | None:
        """The next batch of the job's dataset, from the shard the chief's queue leased this
        worker; None when there is none to train now (training is over, the ps tier was
        recovered, or no shard is free yet: ask `should_stop` again)."""
        self._marks, self._void = [time.perf_counter()], False
        self.link.waiting = "a shard of the data from the chief's queue (Lease)"
        try:
            at = self.link.position = self.feed.batch()
        except TrainingOverError:
            self._over = True
            return None
        self.task.metrics.data_epoch.set(self.feed.epoch)
        try:
            if at is None:  # no shard now: the chief brings the ps tier up, or the epoch ends
                self._no_shard()
                return None
            if at.skip:  # diverged before: the position moves past it, no gradient
                self._push_nothing(at)
                return None
        except PsClientError as err:
            self._recovered(self.link.failed(err))
            return None
        self.link.waiting = f"batch {at.batch} of data epoch {at.epoch} from the dataset"
        with outcome.user_code("the dataset's train_batch", task=self.task.name):
            batch = self.plan.read(self.task.dataset, epoch=at.epoch, batch=at.batch)
        self._examples = len(next(iter(batch.values()))) if batch else 0
        self.link.waiting = IN_OWN_CODE
        return batch

    def pull(
        self,
        variables: Collection[str] | None = None,
        *,
        rows: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """The values of `variables` (default: every dense variable) and the `rows` of tables
        ({table: row ids}) at the global step: in sync the step the last push completed. A ps
        lost meanwhile: waits until the tier is ready again, then reads at its step."""
        if not self._marks:
            self._marks = [time.perf_counter()]
        dense = list(variables) if variables is not None else self.task.dense_variables
        while True:
            if self._pulled is not None and not rows and variables is None:
                step, self._pulled = self._pulled, None
                values = dict(self._buffers or {})
                break
            self._pulled = None
            self.link.waiting = f"the parameters of step >= {self._min_step} from every ps (Read)"
            try:
                step, values = self.client.read(
                    min_step=self._min_step,
                    into=self._buffers if variables is None else None,
                    variables=dense,
                    rows=rows,
                )
            except PsClientError as err:
                self._recovered(self.link.failed(err))
                self._void = True  # the lease of this step's batch is void: it is not pushed
                if self._over:
                    return {}
                continue
            if variables is None:
                self._buffers = {name: values[name] for name in dense}
            break
        self.link.step = step
        self.task.metrics.global_step.set(step)
        if step >= self.task.training.steps:
            self._over = True
        self._marks = [*self._marks[:1], time.perf_counter()]
        self.link.waiting = IN_OWN_CODE
        return values

    def push(
        self,
        grads: Mapping[str, Any],
        *,
        rows: Rows | None = None,
        counts: Mapping[str, np.ndarray] | None = None,
        loss: float | None = None,
        finite: bool | None = None,
    ) -> bool:
        """Pushes the gradients of the step pulled last (named as `pull` names the values; a
        subset pushes only those) and of table `rows` ({table: (row ids, rows)}; `counts`: a
        dynamic table's ids' occurrences in the batch, default 1 each). Each ps's optimizer
        applies them. True when the batch counted on every ps; False when it did not
        (a sync step closed without it, a ps lost, training over): the loop goes on with the
        next batch, which the session gives again if it is to be trained again. `finite`: the
        caller checked the loss and gradients already (else the session checks them)."""
        if self._over or self._void:
            self._void, self._marks = False, []
            return False
        named = _declared(self.task.placement.variables, grads, rows)
        dense = [name for name in named if name not in (rows or {})]
        if loss is not None:
            self.link.record_loss(float(loss))
            self.task.metrics.loss.set(self.link.loss)
        if finite is None:
            finite = all(np.isfinite(g).all() for g in named.values()) and (
                loss is None or math.isfinite(float(loss))
            )
        if not finite:
            self.link.diverge(divergence.what_is_not_finite(self.link.loss, named))
            self._recovered(self.link.recover("its step diverged"))
            return False
        computed = time.perf_counter()
        step, at = self.link.step, self.link.position
        # Sync without tables: the update brings the next step's values (what the next read
        # would wait for). Otherwise the next step reads afresh, as TensorFlow's workers do.
        keep = self._sync and not rows and set(dense) == set(self.task.dense_variables)
        self.link.waiting = (
            f"the other workers' gradients of step {step} (sync Update)"
            if self._sync
            else f"every ps to apply its update of step {step} (Update)"
        )
        try:
            next_step, values, replies = self.client.update(
                named,
                step=step,
                variables=dense,
                rows=rows,
                counts=counts,
                shard=at.shard if at else "",
                cursor=at.cursor if at else 0,
                lease=at.lease if at else 0,
                then_read=keep,
                min_step=step + 1 if keep else 0,
                into=self._buffers,
            )
        except PsClientError as err:
            self._recovered(self.link.failed(err))
            return False
        applied = self.feed.settle(replies, step=step) if at is not None else True
        if keep and (applied or not refused_position(replies)):
            self._buffers, self._pulled = values, next_step
        self._next(replies, step=step)
        _timed(self.link, self._marks, computed, examples=self._examples, step=step)
        self._marks, self._examples, self.link.waiting = [], 0, IN_OWN_CODE
        return applied

    def params(self) -> Any:
        """`pull()` of every dense variable, as the pytree the variables were declared in."""
        return self.task.layout.unflatten(self.pull())

    def push_tree(self, grads: Any, *, loss: Any = None) -> bool:
        """`push` of gradients given as the variables' pytree (a `jax.grad` of `params()`), or a
        part of it ({"generator": ...} pushes only those variables)."""
        named = placement.named_leaves(grads)[1]
        return self.push(named, loss=None if loss is None else float(loss))

    # --- steps without a gradient -----------------------------------------------------------------

    def _no_shard(self) -> None:
        """No shard now: a sync step waits for every live worker, so its share is nothing; in
        bounded staleness a word that it holds nobody back; else it waits for a shard."""
        training = self.task.training
        self.link.waiting, share = self.feed.waiting, not self.feed.hold
        if self._sync and share:
            self._push_nothing(None)
            return
        if share and training.mode is ModeKind.BOUNDED_STALENESS:
            self._push_nothing(None, min_step=0)
            self.feed.wait(min(0.05, training.heartbeatSeconds))
        else:  # back as soon as a shard is in
            self.feed.wait(min(0.25, training.heartbeatSeconds))
        self._min_step = 0

    def _push_nothing(self, at: Position | None, *, min_step: int | None = None) -> None:
        """A push with no gradient: a skipped batch's position (`at`), or, with no batch, this
        worker's share of a sync step (or, bounded staleness, a word that it holds nobody back)."""
        self.link.waiting = (
            f"the ps tier's step >= {self._min_step} (Read)" if at else self.feed.waiting
        )
        self._pulled = None
        steps = self.task.training.steps
        wait_for = self._min_step if min_step is None else min_step
        step, _ = self.client.read(min_step=wait_for, variables=[])
        self.link.step = step
        if step >= steps:
            self._over = True
            return
        _, _, replies = self.client.update(
            {},
            step=step,
            variables=[],
            shard=at.shard if at else "",
            cursor=at.cursor if at else 0,
            lease=at.lease if at else 0,
            idle=at is None,
        )
        if at is not None:
            self.feed.settle(replies, step=step)
        if min_step is None:
            self._next(replies, step=step)

    def _next(self, replies: list[Any], *, step: int) -> None:
        self._min_step = _next_min_step(replies, step=step, sync=self._sync, steps=self.steps)

    def _recovered(self, ready: bool) -> None:
        """After a wait for the ps tier: it may have rolled back, so the next pull reads at any
        step; or training ended meanwhile (not `ready`)."""
        self._pulled, self._min_step = None, 0
        if not ready:
            self._over = True


def _next_min_step(replies: list[Any], *, step: int, sync: bool, steps: int) -> int:
    """The step the next read waits for after an update of `step` (`steps`: training is over).
    Training is over once every ps has reached the last step: a ps behind (a push of a worker
    that died reached only the others) still takes batches, which the ps past it refuse."""
    if replies and min(r.step for r in replies) >= steps:
        return steps
    if refused_position(replies):  # it did not count: the step may wait for it
        return 0
    return step + 1 if sync else 0


_NAMES_SHOWN = 12  # variable names an error lists


def _declared(
    variables: Sequence[Any], grads: Mapping[str, Any], rows: Rows | None
) -> dict[str, np.ndarray]:
    """The pushed gradients as arrays. Raises ValueError naming one whose name is no variable
    of the session: it would be dropped without a word, and the job trained nothing (`W`
    pushed for `w`)."""
    named = {name: np.asarray(g) for name, g in grads.items()}
    names = {v.name for v in variables}
    unknown = sorted({*named, *(rows or {})} - names)
    if unknown:
        shown = sorted(names)[:_NAMES_SHOWN]
        more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
        raise ValueError(
            f"push: gradients for {', '.join(unknown[:_NAMES_SHOWN])}, which "
            f"{'is' if len(unknown) == 1 else 'are'} not a variable of this session (its "
            f"variables: {', '.join(shown)}{more}); name them as params() does"
        )
    return named


def _timed(
    link: Link, marks: Sequence[float], computed: float, *, examples: int, step: int
) -> None:
    """Records one step's pull, compute and push seconds (`marks`: when the step started and
    its pull ended, as far as the step got; `computed`: when its gradients were in hand)."""
    started, pulled = ([*marks, computed, computed])[:2]
    link.times.add(
        pull=pulled - started,
        compute=computed - pulled,
        push=time.perf_counter() - computed,
        examples=examples,
        step=step,
    )
