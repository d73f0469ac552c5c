"""The last checkpoint of a chief told to stop by SIGTERM, as TensorFlow's
PreemptionCheckpointHandler writes one on a preemption notice: a preempted job loses no work.

Kueue preempts a job through the operator, which deletes the chief, the workers and the
evaluator first (SIGTERM, within the pod's grace period) and the ps tasks only once the chief is
gone. So a chief with `training.checkpoint.dir` that gets SIGTERM checkpoints the step the ps
tier holds before it exits (still with 143: the operator's handling is unchanged), and a
replacement chief restores from it as from any checkpoint (`recovery`). SIGINT (`jaxps local`'s
Ctrl-C) stays prompt: no checkpoint.

In order (`Preemption.run`), all before a deadline:
1. Settle. The workers are stopped at the same time and finish the push they are in
   (`stopping.PUSH_GRACE_SECONDS`), so the chief looks at the ps tier until its step has stood
   still for `STILL_SECONDS`, and for `SETTLE_SECONDS` at most: workers that go on training
   are no reason to wait.
2. The periodic checkpoint in flight is waited for when every ps is at or past its step (each
   took its snapshot and writes its file: it commits in the time that takes, and a second Save
   of that step would write the very same files), abandoned otherwise (with `everySteps` a Save
   is always pending at the next multiple, a step the stopping workers never push to).
3. Save at the step the ps tier holds: each ps snapshots at once. In sync mode that cut is
   consistent; in async and bounded mode it is as fuzzy as a periodic checkpoint's. Were the
   step still moving, at the next step (as a periodic checkpoint with `everySeconds` does),
   looking again if the tier passed it first. Nothing is written when that step's checkpoint
   is already committed.

The deadline: `JAXPS_PREEMPT_CHECKPOINT_SECONDS` after the signal (default 20, below
Kubernetes' default grace period of 30 s; 0: no checkpoint); `hold` pushes `stopping`'s
backstop to `MARGIN_SECONDS` past it, and the deadline never comes later than that. Past it,
the Saves in flight end and nothing is committed: the previous checkpoint stays, as when any
checkpoint fails. The chief's main thread only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from jaxps_runtime.client.psclient import PsClient, PsClientError
from jaxps_runtime.process import stopping
from jaxps_runtime.train import checkpoint, watch
from jaxps_runtime.train.chief.checkpointer import Checkpointer
from jaxps_runtime.train.task import Task

log = logging.getLogger(__name__)

ENV = "JAXPS_PREEMPT_CHECKPOINT_SECONDS"
DEFAULT_SECONDS = 20.0
# A push in flight at the signal lands within PUSH_GRACE_SECONDS, or never.
STILL_SECONDS = stopping.PUSH_GRACE_SECONDS + 0.5
SETTLE_SECONDS = 2 * STILL_SECONDS
LOOK_SECONDS = 0.25  # between two looks at the ps tier
MARGIN_SECONDS = 1.0  # before stopping's backstop: the manifest's commit, the way out
PREFIX = "preempted (SIGTERM): "


class NotSavedError(Exception):
    """Why the preempted chief commits no checkpoint."""


def seconds(environ: Mapping[str, str] = os.environ) -> float:
    """`JAXPS_PREEMPT_CHECKPOINT_SECONDS`: the time a preempted chief gives its checkpoint (0:
    none); the default, with a warning, when it is not a number of seconds >= 0."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        log.warning("%s=%r is not a number of seconds >= 0: using %g", ENV, raw, DEFAULT_SECONDS)
        return DEFAULT_SECONDS
    return value


def target(steps: Sequence[int], *, settled: bool, avoid: int | None = None) -> int:
    """The step to save at: the step every ps holds once it stands still, else the next one
    (past the furthest ps); never `avoid`, the step of an abandoned Save whose files a ps may
    still be writing."""
    step = max(steps) if settled else max(steps) + 1
    return step + 1 if step == avoid else step


class Preemption:
    """The preempted chief's last checkpoint (`run`). Notes when the task is told to stop, as
    `stopping`'s backstop starts counting then."""

    def __init__(self, task: Task, *, checkpointer: Checkpointer, seconds: float) -> None:
        self.task = task
        self.checkpointer = checkpointer
        self.seconds = seconds
        self._signalled: float | None = None
        task.stop.callback(self._note)

    def _note(self) -> None:
        self._signalled = time.monotonic()

    def run(self, client: PsClient, *, brought_up: bool) -> None:
        """On SIGTERM, commits a checkpoint of the step the ps tier holds, or logs why not;
        nothing on any other stop. `client`: the chief's (its epoch and incarnations are the
        tier's); `brought_up`: whether this chief brought the ps tier up."""
        if self.task.stop.received != signal.SIGTERM:
            return
        root = self.checkpointer.root
        started = time.monotonic()
        limit = self._limit()
        before = self.checkpointer.last_step  # this chief's last committed checkpoint
        if root is None or self.seconds <= 0:  # the job's choice: no warning
            why = "training.checkpoint.dir is not set" if root is None else f"{ENV} is 0"
            log.info("%sno checkpoint: %s", PREFIX, why)
            return
        try:
            if not brought_up:
                raise NotSavedError("the ps tier was not brought up yet")
            step = self._checkpoint(client, root=root, deadline=started + limit)
        except NotSavedError as why:
            log.warning("%sno checkpoint: %s", PREFIX, why)
            return
        except stopping.Stopped:
            log.warning(
                "%sno checkpoint: not committed within %.1f s (%s); the previous one stays",
                PREFIX,
                limit,
                ENV,
            )
            return
        except (PsClientError, OSError, checkpoint.CheckpointError) as err:
            log.warning("%sno checkpoint: %s", PREFIX, err)
            return
        except Exception:  # it runs on the chief's way out, which must go on
            log.exception("%sno checkpoint", PREFIX)
            return
        finally:
            self.checkpointer.abandon()
        seconds = time.monotonic() - started
        if self.checkpointer.last_step == step != before:  # by `save`, or the periodic one
            log.info("%scheckpoint of step %d committed in %.2f s", PREFIX, step, seconds)
        else:
            log.info("%sno new checkpoint: the one of step %d is already committed", PREFIX, step)

    def hold(self) -> None:
        """Pushes `stopping`'s backstop after SIGTERM past the deadline (a chief with a
        checkpoint directory only, before any signal)."""
        if self.checkpointer.root is not None and self.seconds > 0:
            self.task.stop.hold(self.seconds + MARGIN_SECONDS)

    def _limit(self) -> float:
        """Seconds from now for the checkpoint: `seconds` after the signal, ending in time
        before `stopping`'s backstop ends the process."""
        since = time.monotonic() - self._signalled if self._signalled is not None else 0.0
        backstop = self.task.stop.backstop_seconds(signal.SIGTERM)
        allowed = min(self.seconds, backstop - MARGIN_SECONDS)
        return max(allowed - since, 0.0)

    def _checkpoint(self, client: PsClient, *, root: Path, deadline: float) -> int:
        """Commits the checkpoint (steps 1-3 of the module's docstring); its step. Raises
        `stopping.Stopped` at the deadline, `NotSavedError` when the ps tier cannot be saved."""
        own = stopping.Stop()  # ends every call of `saver` at the deadline
        timer = threading.Timer(max(deadline - time.monotonic(), 0.0), own.request)
        timer.daemon = True
        timer.start()
        saver = self.task.ps_client(stop=own)
        saver.epoch, saver.incarnations = client.epoch, list(client.incarnations)
        try:
            steps, settled = self._settle(saver, own, deadline=deadline)
            abandoned = self._periodic(min(steps), deadline=deadline)
            last = self.task.training.steps
            while True:
                # Never past the last step: the ps tier never gets there.
                step = min(target(steps, settled=settled, avoid=abandoned), last)
                if checkpoint.manifest_path(root, step).exists():
                    return step
                self._quiet(root, step, own)
                try:
                    self.checkpointer.save(
                        saver,
                        step=step,
                        epoch=saver.epoch,
                        timeout=max(deadline - time.monotonic(), 0.1),
                    )
                    return step
                except PsClientError as err:
                    if err.code != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    log.info("%s; looking at the ps tier again", err)  # it passed the step
                steps, settled = self._look(saver), False
        finally:
            timer.cancel()
            saver.close()

    def _look(self, saver: PsClient) -> list[int]:
        """Every ps's step; `NotSavedError` unless every ps is READY at the chief's epoch and
        incarnation (a rollback or a ps restart was under way: nothing sound to save)."""
        seen = [watch.PsSeen.of(s) for s in saver.statuses(timeout=5)]
        state = watch.State(epoch=saver.epoch, incarnations=tuple(saver.incarnations), live=())
        problem = watch.ps_problem(state, seen)
        if problem is not None:
            raise NotSavedError(problem)
        return [ps.step for ps in seen]

    def _settle(
        self, saver: PsClient, own: stopping.Stop, *, deadline: float
    ) -> tuple[list[int], bool]:
        """The ps steps once they are one step that has not moved for `STILL_SECONDS` (True),
        or as they are after `SETTLE_SECONDS` of moving (False)."""
        now = time.monotonic()
        until = min(now + SETTLE_SECONDS, deadline)
        steps, since = self._look(saver), now
        while True:
            own.sleep(LOOK_SECONDS)
            last, steps, now = steps, self._look(saver), time.monotonic()
            if steps != last:
                since = now
            elif len(set(steps)) == 1 and now - since >= STILL_SECONDS:
                return steps, True
            if now >= until:
                return steps, False

    def _periodic(self, reached: int, *, deadline: float) -> int | None:
        """Waits for the periodic checkpoint in flight if every ps `reached` its step, else
        abandons it; the step of an abandoned one."""
        step = self.checkpointer.in_flight
        if step is None:
            return None
        if step <= reached:
            log.info("waiting for the checkpoint of step %d in flight", step)
            if not self.checkpointer.wait(timeout=max(deadline - time.monotonic(), 0.0)):
                raise stopping.Stopped(f"the checkpoint of step {step} took too long")
            return None
        self.checkpointer.abandon()
        return step

    @staticmethod
    def _quiet(root: Path, step: int, own: stopping.Stop) -> None:
        """Waits while a ps writes a file of `step` for a Save that ended without its reply
        (the final checkpoint's, cut off by the signal): a second Save of the step would write
        the same file at the same time. A file left by a ps that died writing is no reason to
        wait: one written to stays younger than `STILL_SECONDS`."""
        directory = checkpoint.step_dir(root, step)

        def writing() -> bool:
            now = time.time()
            for partial in directory.glob("*.tmp"):
                with contextlib.suppress(OSError):  # renamed meanwhile: written
                    if now - partial.stat().st_mtime < STILL_SECONDS:
                        return True
            return False

        while writing():
            own.sleep(LOOK_SECONDS)
