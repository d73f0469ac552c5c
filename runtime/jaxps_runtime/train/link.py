"""A worker's tie to its job, under its `train.session.Session`: registration and heartbeats to
the chief (the step, the loss, the step times, what it waits for), waiting out a ps tier that is
lost or rolled back, a divergence reported or ending the job, and the wait for the chief once
training is over (during which a rollback can send the worker back to training).

The session's loop thread calls it, and its heartbeat thread reads whole values.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import grpc

from jaxps_runtime.client.errors import PsLayoutError
from jaxps_runtime.client.psclient import PsClientError, PsRestartedError
from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.train import divergence, outcome, timing
from jaxps_runtime.train.coordinator import CoordinatorClient
from jaxps_runtime.train.feed import Feed, Position
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


class Link:
    """A worker's tie to its job (see the module's doc); its session holds it."""

    def __init__(self, task: Task, *, coordinator: CoordinatorClient, feed: Feed) -> None:
        self.task = task
        self.client = task.ps_client()
        self.coordinator = coordinator
        self.feed = feed
        self.finished = threading.Event()  # the chief says training is over
        self.step = 0  # the global step last seen
        self.loss = math.nan
        self.first_loss: dict[str, float] = {}  # its first finite loss and step, heartbeaten
        self.times = timing.StepTimes()
        self.waiting = ""  # what the worker waits for now: its heartbeats say it
        self.drained = False  # its training is over; it waits for the chief to end the job
        self.last_heard = time.monotonic()  # the chief's last answer to a heartbeat
        self.diverged: dict[str, float] = {}  # the report of a divergence not rolled back yet
        self.position: Position | None = None  # the batch of the step under way
        self.beats: threading.Thread | None = None

    def start(self, plan: ShardPlan) -> None:
        """Registers with the chief, heartbeats, and waits until every ps is ready (the chief
        initialises or restores them)."""
        training = self.task.training
        self.coordinator.register(timeout=training.startupTimeoutSeconds)
        # heartbeats from registration on: a worker waiting for the ps is alive
        self.beats = threading.Thread(
            target=self._heartbeats, kwargs={"every": training.heartbeatSeconds}, daemon=True
        )
        self.beats.start()
        self.waiting = "every ps to be ready (the chief initialises or restores them)"
        self.step = self.client.wait_ready(timeout=training.startupTimeoutSeconds)
        where = f"{self.task.name}: ps ready at step {self.step} (epoch {self.client.epoch})"
        log.info("%s; training %s on the chief's shards (%s)", where, training.mode, plan)

    # --- heartbeats -----------------------------------------------------------------------------

    def beat(self, *, done: bool) -> Any:
        """One heartbeat: the step, the loss, the step times, what it waits for."""
        return self.coordinator.heartbeat(
            step=self.step,
            loss=self.loss,
            done=done,
            metrics={**self.times.means(), **self.diverged, **self.first_loss},
            examples_per_second=self.times.examples_per_second(),
            waiting="" if done else self.waiting,
        )

    def record_loss(self, loss: float) -> None:
        """The loss of the step under way; the first finite one stays, for the chief's check
        that training did not only get worse (`divergence.grown`)."""
        self.loss = loss
        if not self.first_loss and math.isfinite(loss):
            self.first_loss = divergence.first_loss_report(step=self.step, loss=loss)

    def _heartbeats(self, *, every: float) -> None:
        while not self.finished.wait(every):
            self.task.metrics.examples_per_second.set(self.times.examples_per_second())
            state = self.beat(done=self.drained)
            if state is not None:
                self.last_heard = time.monotonic()
            if state is not None and state.stop:
                log.info("%s: the chief says training is over", self.task.name)
                self.finished.set()

    # --- the ps tier lost, rolled back, or at its end ---------------------------------------

    def failed(self, err: PsClientError) -> bool:
        """A call to the ps tier failed: a divergence refused, or the tier lost or rolled back
        (waited out: True once ready again, False if training ended meanwhile); anything else
        ends the worker (raised)."""
        if isinstance(err, PsLayoutError):  # no retry changes it: it flooded the log
            raise outcome.UserCodeError(
                f"{self.task.name}: its variables are not those the ps tier holds (the chief "
                f"initialised it with its own): {err.details}; every task must declare the "
                "same variables"
            ) from None
        if divergence.refused_as_not_finite(err):
            self.diverge(f"a ps refused its update: {err}")
        elif err.code not in RECOVERABLE and not isinstance(err, PsRestartedError):
            raise err
        return self.recover(err)

    def diverge(self, what: str) -> None:
        """The loss, a gradient or an update is not finite at this step and batch: the job
        ends, or the worker reports it for a rollback (`divergence.on_worker`)."""
        at = self.position
        self.diverged = divergence.on_worker(
            self.task,
            what,
            step=self.step,
            batch=at.batch if at else -1,
            data_epoch=at.epoch if at else -1,
            epoch=self.client.epoch,
        )

    def recover(self, err: PsClientError | str) -> bool:
        """Waits until every ps is ready again at one epoch (a newer one after a reported
        divergence); False if training ended meanwhile."""
        log.warning("%s: %s; waiting for the ps tier to be ready again", self.task.name, err)
        started = time.monotonic()
        diverged_at = int(self.diverged[divergence.DIVERGED_EPOCH]) if self.diverged else None
        self.waiting = "every ps to be ready again (a rollback)"
        self.client.incarnations = [0] * len(self.client.incarnations)
        timeout = self.task.training.startupTimeoutSeconds
        while not self.finished.is_set():
            try:
                self.step = self.client.wait_ready(timeout=2.0)
            except (TimeoutError, PsClientError):
                if time.monotonic() - started > timeout:
                    raise
                continue
            if diverged_at is not None and self.client.epoch <= diverged_at:
                if time.monotonic() - started > timeout:
                    raise TimeoutError(
                        f"{self.task.name}: reported a divergence, and the chief did not roll "
                        f"the ps tier back within {timeout} s"
                    )
                self.task.stop.sleep(min(0.2, self.task.training.heartbeatSeconds))
                continue
            self.diverged = {}
            self.feed.reset()  # the queue starts over from the ps tier's positions
            seconds = time.monotonic() - started
            log.info(
                "%s: ps tier ready again at step %d after %.1f s",
                self.task.name,
                self.step,
                seconds,
            )
            return True
        return False

    def drain(self) -> bool:
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
                self.feed.reset()
                return True
        return False
