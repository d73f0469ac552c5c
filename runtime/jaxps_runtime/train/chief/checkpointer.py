"""The chief's checkpoints: periodic ones in a background thread, one at a time, the final one
(`finish`) and the last one of a preempted chief (`preemption`). A checkpoint that fails (a ps
died while writing) is simply not committed; `checkpoint.save` never commits one it has not got
every shard of."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from jaxps_runtime.client.psclient import PsClient, PsClientError
from jaxps_runtime.process import stopping
from jaxps_runtime.train import checkpoint, watch
from jaxps_runtime.train.task import Task

log = logging.getLogger(__name__)


class Checkpointer:
    """The chief's checkpoints: periodic ones in a background thread, one at a time, and the
    final one. A checkpoint that fails (a ps died while writing) is simply not committed.

    The task's stop ends the periodic checkpoint in flight, except SIGTERM with
    `keep_on_sigterm`: then the preempted chief decides about it (`preemption`), and ends it
    with `abandon` in any case. `save` is the main thread's; `start` runs one in a thread."""

    def __init__(self, task: Task, *, keep_on_sigterm: bool = False) -> None:
        self.task = task
        self.keep_on_sigterm = keep_on_sigterm
        config = task.training.checkpoint
        self.root = Path(config.dir) if config.dir else None
        self.every_steps = config.everySteps
        # TensorFlow's CheckpointSaverHook default when neither is given: every 600 s.
        self.every_seconds = config.everySeconds or (None if config.everySteps else 600.0)
        self.last_step: int | None = None
        self._thread: threading.Thread | None = None
        self._stop: stopping.Stop | None = None
        self._target: int | None = None  # the step of the periodic checkpoint in flight

    @property
    def busy(self) -> bool:
        """Whether a periodic checkpoint is being written (one at a time)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_flight(self) -> int | None:
        """The step of the periodic checkpoint being written, if one is."""
        return self._target if self.busy else None

    def policy(self, *, steps: int) -> watch.Policy:
        """When periodic checkpoints are due (`watch.checkpoint_target`)."""
        return watch.Policy(
            steps=steps,
            checkpoints=self.root is not None,
            every_steps=self.every_steps,
            every_seconds=self.every_seconds,
        )

    def start(self, *, step: int, epoch: int, incarnations: list[int]) -> None:
        # Its own stop, set by the task's or by `abandon`: a Save waiting for a step that
        # never comes would otherwise hold the process at exit (its pool's threads are joined).
        stop = self._stop = stopping.Stop()
        self._target = step

        def task_stopped() -> None:
            if not (self.keep_on_sigterm and self.task.stop.received == signal.SIGTERM):
                stop.request()

        unlink = self.task.stop.callback(task_stopped)

        def run() -> None:
            client = self.task.ps_client(stop=stop)
            client.epoch, client.incarnations = epoch, list(incarnations)
            try:
                self.save(client, step=step, epoch=epoch)
            except (PsClientError, OSError, checkpoint.CheckpointError) as err:
                log.warning("checkpoint of step %d not committed: %s", step, err)
            except stopping.Stopped as stopped:
                log.info("checkpoint of step %d not committed: %s", step, stopped)
            finally:
                client.close()
                unlink()

        self._thread = threading.Thread(target=run, name="checkpoint", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits (up to `timeout` seconds) for the periodic checkpoint in flight; whether
        none is in flight any more."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        return not self.busy

    def abandon(self) -> None:
        """Ends the periodic checkpoint in flight, uncommitted (the chief is going)."""
        if self.busy and self._stop is not None:
            self._stop.request()
            self.wait()

    def save(
        self, client: PsClient, *, step: int, epoch: int, timeout: float | None = None
    ) -> None:
        """Commits the checkpoint of `step` (each ps saves its part when it gets there, for at
        most `timeout` seconds: by default, long enough for a slow step and a large model)."""
        assert self.root is not None
        training = self.task.training
        started = time.monotonic()
        manifest = checkpoint.save(
            client,
            root=self.root,
            step=step,
            epoch=epoch,
            placement=self.task.placement.to_dict(),
            optimizer=training.optimizer.to_json(),
            mode=training.mode,
            keep=training.checkpoint.keep,
            timeout=timeout or max(120.0, 10 * training.workerTimeoutSeconds),
        )
        self.last_step = step
        self.task.metrics.last_checkpoint_step.set(step)
        size = sum(r.bytes for r in manifest.shards)
        log.info(
            "checkpoint of step %d committed (%.1f MB in %.2f s)",
            step,
            size / 1e6,
            time.monotonic() - started,
        )
