"""The chief's checkpoints: periodic ones in a background thread, one at a time, and the
final one (`finish`). A checkpoint that fails (a ps died while writing) is simply not
committed; `checkpoint.save` never commits one it has not got every shard of."""

from __future__ import annotations

import logging
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
    final one. A checkpoint that fails (a ps died while writing) is simply not committed."""

    def __init__(self, task: Task) -> None:
        self.task = task
        config = task.training.checkpoint
        self.root = Path(config.dir) if config.dir else None
        self.every_steps = config.everySteps
        # TensorFlow's CheckpointSaverHook default when neither is given: every 600 s.
        self.every_seconds = config.everySeconds or (None if config.everySteps else 600.0)
        self.last_step: int | None = None
        self._thread: threading.Thread | None = None
        self._stop: stopping.Stop | None = None

    @property
    def busy(self) -> bool:
        """Whether a periodic checkpoint is being written (one at a time)."""
        return self._thread is not None and self._thread.is_alive()

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
        unlink = self.task.stop.callback(stop.request)

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

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def abandon(self) -> None:
        """Ends the periodic checkpoint in flight, uncommitted (the chief is going)."""
        if self.busy and self._stop is not None:
            self._stop.request()
            self.wait()

    def save(self, client: PsClient, *, step: int, epoch: int) -> None:
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
            timeout=max(120.0, 10 * training.workerTimeoutSeconds),
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
