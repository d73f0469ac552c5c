"""TensorBoard event files (`training.tensorboard`), written with tensorboardX: no TensorFlow.

Two runs under `dir`, as TensorFlow's estimators laid them out, so that `tensorboard --logdir
dir` draws the training and the evaluation curves of a tag in one chart:
- `dir/train`, by the chief at each of its log ticks (`logEverySeconds`) where the global step
  moved, and at the last step; x axis the global step: `loss` (mean over the workers' last
  heartbeats), `steps/s` (global steps per second), `examples/s` (summed over the workers) and
  `step_seconds/pull`, `step_seconds/compute`, `step_seconds/push` (the mean split of a
  worker's step, in seconds);
- `dir/eval`, by the evaluator at each evaluation, x axis the step it evaluated: the model's
  metrics by name (`accuracy`, `loss`, ...); without an evaluator, the chief writes its final
  evaluation there.

Every writer opens a new file (`events.out.tfevents.<time>.<host>.<task>.<pid>`), never
appends to one: a replacement chief adds its file next to its predecessor's, and TensorBoard
reads them in order. A chief that rolled the ps tier back to a checkpoint (a restore at start,
a ps restart) writes a `SessionLog.START` at that step, which tells TensorBoard to drop the
points past it (they were undone), as TensorFlow's chief did.

`Writer` is thread-safe and never makes its caller wait on the disk: `scalars` only queues;
one thread per writer opens the file, writes, and flushes so that no event waits in memory
longer than `flushSeconds` (what was flushed survives a SIGKILL). `close` writes what is
queued, waiting at most `timeout` (the task's `finally` on success, failure and SIGTERM alike).
A directory that cannot be written, a full disk or tensorboardX missing stop that writer
only: one warning in the task's log, and training goes on without event files. tensorboardX
is imported by the writing thread, only when a directory is configured.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxps_runtime.config.training import TensorBoardConfig

log = logging.getLogger(__name__)

TRAIN, EVAL = "train", "eval"
"""The runs under `training.tensorboard.dir`: the chief's and the evaluator's."""

LOSS, STEPS_PER_SECOND, EXAMPLES_PER_SECOND = "loss", "steps/s", "examples/s"
STEP_SECONDS = "step_seconds"  # + "/pull", "/compute", "/push"
QUEUE_LIMIT = 1000  # events waiting for the writing thread; past it, new ones are dropped
CLOSE_TIMEOUT_SECONDS = 5.0
FILE_VERSION = "brain.Event:2"  # the event format TensorBoard expects (and purges by)


@dataclass(frozen=True)
class _Scalars:
    step: int
    wall_time: float
    values: Mapping[str, float]


@dataclass(frozen=True)
class _Start:
    step: int
    wall_time: float


_CLOSE = object()


def path(config: TensorBoardConfig, run: str) -> str:
    """The directory of one run's event files (a string: tensorboardX also takes gs:// and
    s3:// URLs, which `pathlib` would mangle)."""
    return os.path.join(config.dir, run)


def step_seconds(split: Mapping[str, float]) -> dict[str, float]:
    """The chief's `step_seconds/...` scalars from a step split {pull, compute, push}."""
    return {f"{STEP_SECONDS}/{phase}": seconds for phase, seconds in split.items()}


class Writer:
    """One task's event files in one run directory; does nothing when `config` is None.

    Thread-safe. Never blocks on I/O and never raises for I/O: see the module's docstring.
    """

    def __init__(self, config: TensorBoardConfig | None, *, run: str, task: str) -> None:
        self.directory = path(config, run) if config is not None else None
        self.task = task
        self.flush_seconds = float(config.flushSeconds) if config is not None else 0.0
        self.file: str | None = None  # once the writing thread opened it
        self._queue: queue.Queue[object] = queue.Queue(maxsize=QUEUE_LIMIT)
        self._lock = threading.Lock()
        self._warned = False
        self._failed = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.directory is not None:
            self._thread = threading.Thread(
                target=self._write, name=f"tensorboard-{run}", daemon=True
            )
            self._thread.start()

    @property
    def active(self) -> bool:
        """Whether events still go to disk: a directory is set, nothing failed, not closed."""
        return self._thread is not None and not self._failed.is_set() and not self._closed

    def scalars(self, values: Mapping[str, float], *, step: int) -> None:
        """Queues one event per tag at `step` (the global step), stamped now."""
        if values:
            self._put(_Scalars(step=step, wall_time=time.time(), values=dict(values)))

    def restarted(self, *, step: int) -> None:
        """Training resumes at `step` after a rollback: TensorBoard drops later points."""
        self._put(_Start(step=step, wall_time=time.time()))

    def close(self, *, timeout: float = CLOSE_TIMEOUT_SECONDS) -> None:
        """Writes what is queued and closes the file, waiting at most `timeout`. Idempotent."""
        with self._lock:
            if self._closed or self._thread is None:
                self._closed = True
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        if not self._failed.is_set():
            try:
                self._queue.put(_CLOSE, timeout=timeout)
            except queue.Full:
                self._warn(f"closing {self.directory}: the writer is stuck; queued events are lost")
                return
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            self._warn(f"event files in {self.directory} not closed within {timeout} s")

    def _put(self, item: object) -> None:
        if not self.active:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._warn(f"{QUEUE_LIMIT} events wait to be written; dropping new ones")

    def _warn(self, message: str) -> None:
        """The writer's one warning: later problems follow from the first, or matter less."""
        with self._lock:
            if self._warned:
                return
            self._warned = True
        log.warning("%s: TensorBoard: %s; training goes on", self.task, message)

    def _write(self) -> None:
        """The writing thread: opens the file, then writes and flushes until `close`."""
        assert self.directory is not None
        try:
            # Only here: tasks without `training.tensorboard` never load tensorboardX (which has
            # no type information: mypy skips it).
            from tensorboardX import record_writer, summary  # noqa: PLC0415
            from tensorboardX.proto import event_pb2  # noqa: PLC0415

            record_writer.directory_check(self.directory)
            # tensorboardX's own name (TensorBoard reads files named *tfevents*, in name order),
            # plus the task and the process, and a number if that is taken (a pod's process
            # is PID 1 whichever incarnation it is): no writer truncates another's file.
            stem = (
                f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
                f".{self.task}.{os.getpid()}"
            )
            name, taken = stem, 0
            while os.path.exists(os.path.join(self.directory, name)):  # opening truncates
                taken += 1
                name = f"{stem}.{taken}"
            file = os.path.join(self.directory, name)
            records = record_writer.RecordWriter(file)
            header = event_pb2.Event(wall_time=time.time(), file_version=FILE_VERSION)
            records.write(header.SerializeToString())
            records.flush()  # the file exists, with its header, before the first tick
        except Exception as err:  # OSError, or an image without tensorboardX
            self._failed.set()
            self._warn(f"cannot write event files in {self.directory}: {err}")
            return
        self.file = file
        log.info("%s: TensorBoard event files in %s (%s)", self.task, self.directory, name)
        try:
            self._loop(records, event_pb2=event_pb2, scalar=summary.scalar)
        except Exception as err:  # a full disk, a directory removed or unmounted
            self._failed.set()
            self._warn(f"writing {file} failed: {err}; no more events from here")
        finally:
            try:
                records.flush()
                records.close()
            except Exception as err:
                self._failed.set()
                self._warn(f"closing {file} failed: {err}")

    def _loop(self, records: Any, *, event_pb2: Any, scalar: Any) -> None:
        """Writes queued events until `_CLOSE`; flushes by `flush_seconds` after the oldest
        unflushed one. `event_pb2` and `scalar` are tensorboardX's, as `_write` imported them."""

        def write(event: Any) -> None:
            records.write(event.SerializeToString())

        flush_by: float | None = None
        while True:
            wait = None if flush_by is None else max(flush_by - time.monotonic(), 0.0)
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _CLOSE:
                return  # the caller flushes and closes
            if isinstance(item, _Scalars):
                for tag, value in item.values.items():
                    summary = scalar(tag, float(value))
                    write(
                        event_pb2.Event(wall_time=item.wall_time, step=item.step, summary=summary)
                    )
            elif isinstance(item, _Start):
                start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
                write(event_pb2.Event(wall_time=item.wall_time, step=item.step, session_log=start))
            if item is not None and flush_by is None:
                flush_by = time.monotonic() + self.flush_seconds
            if flush_by is not None and time.monotonic() >= flush_by:
                records.flush()
                flush_by = None
