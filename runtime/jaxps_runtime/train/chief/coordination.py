"""The chief's watch over training, from the ps tier's bring-up to the last step.

It brings every ps up (adopted, restored or initialised: `recovery`), then looks at the ps tier
and the workers' heartbeats a few times a second and carries out what `watch.decide` makes of
each look: a ps lost or restarted rolls every ps back to the last committed checkpoint, a worker
silent for `workerTimeoutSeconds` is dropped from the live set the ps tasks aggregate over,
periodic checkpoints start when due. It also rolls back on a worker's report of a divergence
(up to `maxRollbacks`), and ends training with `outcome.StalledError` when the global step
stands still for `progressTimeoutSeconds`, naming what each task waits for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.client.psclient import PsClient, PsClientError, PsRestartedError, merged_cursors
from jaxps_runtime.config.training import TrainingConfig
from jaxps_runtime.train import divergence, outcome, recovery, watch
from jaxps_runtime.train.chief.checkpointer import Checkpointer
from jaxps_runtime.train.chief.progress import Progress, rate
from jaxps_runtime.train.coordinator import Member, Membership
from jaxps_runtime.train.shardqueue import ShardQueue
from jaxps_runtime.train.task import Task
from jaxps_runtime.wire import terms
from jaxps_runtime.wire.terms import Mode

log = logging.getLogger(__name__)

# How a ps that went away answers (or rather, does not).
_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
STATUS_SECONDS = 10.0  # how long a look waits for each ps's Status
_SAY_STILL = 30.0  # seconds the step stands still before the progress line says why


def ps_mode(training: TrainingConfig) -> Mode:
    """The mode every ps is given at Init: the job's, refusing pushes from its last step on."""
    return terms.wire_mode(training.training_mode, last_step=training.steps)


def ps_gone(err: PsClientError) -> bool:
    """Whether a call failed because a ps went away or came back a new incarnation: the chief
    recovers from that rather than fail."""
    return err.code in _GONE or isinstance(err, PsRestartedError)


class Coordination:
    """Brings the ps tier up and watches training to its last step, for the chief.

    Not thread-safe: the chief's main thread only (the `Membership` it reads is thread-safe).
    `recoveries` and `started_from` are the job's history for its summary."""

    def __init__(
        self,
        task: Task,
        *,
        membership: Membership,
        checkpointer: Checkpointer,
        progress: Progress,
        queue: ShardQueue,
    ) -> None:
        self.task = task
        self.queue = queue
        self.training = task.training
        self.membership = membership
        self.checkpointer = checkpointer
        self.progress = progress
        self.recoveries: list[dict[str, Any]] = []
        self.started_from: dict[str, Any] = {}
        self.rollbacks = 0  # on divergence (training.onDivergence: rollback)
        self._seen: tuple[watch.PsSeen, ...] = ()  # the last look at the ps tier
        self._silent = ""  # why a ps did not answer the last look in time
        self._reclaimed = 0  # leases taken back, as the metric counts them

    def initialise(self, client: PsClient) -> None:
        training = self.training
        log.info(
            "waiting for %d ps: %s",
            len(client.addresses),
            ", ".join(f"ps-{i} at {a}" for i, a in enumerate(client.addresses)),
        )
        client.wait_reachable(timeout=training.startupTimeoutSeconds)
        ready = recovery.bring_up(
            client, self.task, mode=ps_mode(training), workers=self.task.worker_names, adopt=True
        )
        self._adopt(ready, client)
        self.membership.watching_from(time.monotonic())
        self.started_from = {"how": ready.how, "step": ready.step}
        log.info(
            "%s at step %d (epoch %d); %s mode, %d steps, checkpoints %s",
            ready.how,
            ready.step,
            ready.epoch,
            training.mode,
            training.steps,
            training.checkpoint.dir or "off",
        )

    def _adopt(self, ready: recovery.Ready, client: PsClient) -> None:
        self.membership.epoch = ready.epoch
        self.membership.step = ready.step
        self.task.metrics.global_step.set(ready.step)
        # The shard queue as the ps tier's data positions say (the checkpoint's, after a
        # restore): leases given before are void.
        self.queue.restore(merged_cursors(client.statuses(timeout=30), how=min))
        if ready.how == "restored":
            self.task.metrics.last_checkpoint_step.set(ready.step)
        self.progress.restarted(step=ready.step, rolled_back=ready.how != "adopted")

    def _recover(self, client: PsClient, problem: str) -> None:
        """Rolls every ps back to the last committed checkpoint, at a new epoch."""
        started, before = time.monotonic(), self.membership.step
        log.warning("%s: rolling every ps back to the last committed checkpoint", problem)
        self.queue.hold()  # no lease of the old queue's until it is rebuilt from the rollback
        # No waiting for a checkpoint in flight: the Init below aborts its pending Saves, and
        # `checkpoint.save` never commits one whose replies are not all from its epoch.
        deadline = started + self.training.startupTimeoutSeconds
        while True:
            client.wait_reachable(timeout=max(deadline - time.monotonic(), 0.0))
            live = self.membership.live_workers(
                now=time.monotonic(), timeout=self.training.workerTimeoutSeconds
            ) or list(self.task.worker_names)
            try:
                ready = recovery.bring_up(
                    client,
                    self.task,
                    mode=ps_mode(self.training),
                    workers=live,
                    adopt=False,
                    epoch_floor=max(self.membership.epoch, client.epoch),
                )
                break
            except PsClientError as err:
                # A ps went away again mid-rollback (it crashed, or was stopped as it came
                # back): wait for it again and roll back at a newer epoch than any half-done one.
                if not ps_gone(err):
                    raise
                log.warning("%s; rolling back again once every ps answers", err)
        self._adopt(ready, client)
        seconds = time.monotonic() - started
        self.task.metrics.recovered_to_step.set(ready.step)
        self.task.metrics.recoveries.inc()
        self.recoveries.append(
            {
                "reason": problem,
                "fromStep": before,
                "toStep": ready.step,
                "seconds": round(seconds, 3),
            }
        )
        log.warning(
            "recovered in %.1f s: %s at step %d (from step %d), epoch %d",
            seconds,
            ready.how,
            ready.step,
            before,
            ready.epoch,
        )

    def _observe(self, client: PsClient) -> watch.Observation:
        """One look: one Status per ps (the step comes from the same replies that say the tier
        is healthy: a second call could meet a ps that died in between, uncaught), and which
        workers were heard from."""
        unreachable = silent = ""
        try:
            replies = client.statuses(timeout=STATUS_SECONDS)
            seen = tuple(watch.PsSeen.of(s) for s in replies)
            if len({r.id.cluster_epoch for r in replies}) == 1:
                self.queue.observe(merged_cursors(replies, how=min))
        except PsClientError as err:
            seen = ()
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                silent = str(err)
            else:
                unreachable = str(err)
        self._silent = silent
        now = time.monotonic()
        alive = self.membership.live_workers(now=now, timeout=self.training.workerTimeoutSeconds)
        if seen:
            self._seen = seen
        return watch.Observation(
            now=now,
            ps=seen,
            unreachable=unreachable,
            silent=silent,
            alive=tuple(alive),
            checkpointing=self.checkpointer.busy,
        )

    def watch(self, client: PsClient, *, check: Callable[[], None]) -> int:
        """Until the global step reaches `steps`; returns 0, or 1 if every worker is gone. The
        decisions are `watch.decide`'s; this carries them out. Raises `outcome.StalledError`
        when the step has not moved for `progressTimeoutSeconds` while training (the clock
        starts again after every start and rollback, and while a ps writes a checkpoint),
        `outcome.DivergedError` past `maxRollbacks`, and what `check` raises (how worker 0's
        thread failed)."""
        training = self.training
        policy = self.checkpointer.policy(steps=training.steps)
        state = watch.State(
            epoch=client.epoch,
            incarnations=tuple(client.incarnations),
            live=tuple(self.task.worker_names),
            last_checkpoint_time=time.monotonic(),
        )
        last_log, last_step, last_time = time.monotonic(), self.membership.step, time.monotonic()
        moved = (self.membership.step, time.monotonic())  # the step, and since when
        said_silent = -math.inf  # when a ps that did not answer was last logged
        self.task.metrics.training.set(1)
        while True:
            check()
            observation = self._observe(client)
            state, actions = watch.decide(policy, state, observation)
            now, step, loss = observation.now, self.membership.step, math.nan
            diverged = divergence.reported(
                self.membership.members(),
                workers=self.membership.workers,
                epoch=self.membership.epoch,
            )
            if diverged and not any(isinstance(a, watch.Recover | watch.Stop) for a in actions):
                actions = [watch.Recover(diverged)]
            for action in actions:
                match action:
                    case watch.Recover(reason=reason):
                        self.task.metrics.training.set(0)
                        if reason is diverged:
                            self._roll_back_divergence(reason)
                            at = divergence.diverged_batch(
                                self.membership.members(),
                                workers=self.membership.workers,
                                epoch=self.membership.epoch,
                            )
                            if at is not None:
                                self.queue.skip(*at)
                        self._recover(client, reason)
                        state = dataclasses.replace(
                            state, epoch=client.epoch, incarnations=tuple(client.incarnations)
                        )
                        moved = (self.membership.step, time.monotonic())
                        self.task.metrics.training.set(1)
                    case watch.Progress(step=step):
                        loss = self.progress.update(step)
                    case watch.Stop(step=step):  # the curves end at the last step
                        self.queue.finish()
                        self.progress.record(
                            step=step, loss=loss, rate=rate(step, last_step, now - last_time)
                        )
                        self.task.metrics.training.set(0)
                        return 0
                    case watch.Checkpoint(step=target):
                        self.checkpointer.start(
                            step=target, epoch=client.epoch, incarnations=client.incarnations
                        )
                    case watch.SetWorkers(workers=workers, gone=gone, back=back):
                        left = set(self.membership.workers)
                        silent = sorted(w for w in gone if w in left)
                        if silent:
                            log.warning(
                                "%s sent no heartbeat for %.0f s: continuing without",
                                ", ".join(silent),
                                training.workerTimeoutSeconds,
                            )
                        for worker in gone:
                            self.queue.reclaim(worker)
                        if back:
                            log.info("%s joins the training", ", ".join(sorted(back)))
                        client.set_workers(list(workers))
                    case watch.GiveUp(reason=reason):
                        log.error(
                            "%s (no heartbeat for %.0f s)", reason, training.workerTimeoutSeconds
                        )
                        return 1
            if any(isinstance(action, watch.Recover) for action in actions):
                continue
            if observation.silent and now - said_silent >= training.logEverySeconds:
                said_silent = now
                log.warning("%s: waiting for it to answer (no rollback)", observation.silent)
            writing = self.checkpointer.in_flight  # a Save pending ahead waits for training:
            if step != moved[0] or (writing is not None and writing <= step):  # not a cause
                moved = (step, now)
            elif 0 < training.progressTimeoutSeconds <= now - moved[1]:
                raise outcome.StalledError(
                    stall_report(
                        self.membership.members(),
                        self._seen,
                        step=step,
                        seconds=now - moved[1],
                        timeout=training.progressTimeoutSeconds,
                    )
                    + (f"; and now {self._silent}" if self._silent else "")
                )
            self._count_data()
            if self.progress.due(step):
                window = rate(step, last_step, now - last_time)
                self.progress.record(step=step, loss=loss, rate=window)
            if now - last_log >= training.logEverySeconds:
                steps_per_second = rate(step, last_step, now - last_time)
                self.task.metrics.steps_per_second.set(steps_per_second)
                shown = f"{loss:.4f}" if step > 0 else "-"  # no loss before the first step
                log.info(
                    "step %d/%d  loss %s  %.1f steps/s",
                    step,
                    training.steps,
                    shown,
                    steps_per_second,
                )
                if now - moved[1] >= _SAY_STILL:  # why, as each task said
                    log.warning(
                        "the global step has not moved from %d for %.0f s: %s",
                        step,
                        now - moved[1],
                        standing(self.membership.members(), self._seen),
                    )
                last_log, last_step, last_time = now, step, now
            self.task.stop.sleep(min(0.2, training.heartbeatSeconds))

    def _count_data(self) -> None:
        counts, metrics = self.queue.counts(), self.task.metrics
        metrics.data_epoch.set(counts.epoch)
        metrics.data_shards.set(counts.shards)
        metrics.data_shards_done.set(counts.done)
        metrics.data_shards_leased.set(counts.leased)
        new = counts.reclaimed - self._reclaimed
        if new > 0:
            metrics.data_leases_reclaimed.inc(new)
            self._reclaimed = counts.reclaimed

    def _roll_back_divergence(self, reason: str) -> None:
        """Counts a rollback on divergence; `outcome.DivergedError` past `maxRollbacks`."""
        self.rollbacks += 1
        limit = self.training.maxRollbacks
        if self.rollbacks > limit:
            raise outcome.DivergedError(
                f"{reason}, and training.maxRollbacks ({limit}) rollbacks are used up; lower "
                "the learning rate"
            )
        log.error(
            "%s: rollback %d of at most %d, skipping that batch", reason, self.rollbacks, limit
        )


def stall_report(
    members: Sequence[Member],
    seen: Sequence[watch.PsSeen],
    *,
    step: int,
    seconds: float,
    timeout: float,
) -> str:
    """Why the step stands still, as each task last said: what each worker and the evaluator
    waits for, and where each ps is."""
    return (
        f"the global step has not moved from {step} for {seconds:.0f} s "
        f"(training.progressTimeoutSeconds: {timeout:g}): " + standing(members, seen)
    )


def standing(members: Sequence[Member], seen: Sequence[watch.PsSeen]) -> str:
    """What each worker and the evaluator last said it waits for, and where each ps is."""
    now = time.monotonic()
    parts = []
    for m in sorted(members, key=lambda m: m.task):
        heard = now - m.last_seen
        doing = f"waits for {m.waiting}" if m.waiting else "has said nothing yet"
        if m.done:
            doing = "is done"
        parts.append(f"{m.task} {doing} (at step {m.step}, last heard {heard:.0f} s ago)")
    for i, ps in enumerate(seen):
        parts.append(
            f"ps-{i} is {ps_pb2.PsState.Name(ps.state)} at step {ps.step} (epoch {ps.epoch})"
        )
    return "; ".join(parts)
