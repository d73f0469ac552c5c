"""Stopping a task cleanly and promptly on SIGTERM or SIGINT, whatever its role.

In a pod, `python -m jaxps_runtime` is PID 1, and a PID 1 without a handler ignores SIGTERM:
the pod would sit Terminating for its whole grace period. So `__main__` installs one `Stop` per
process for every role and passes it down. Every blocking wait polls it instead of sleeping
(`stop.sleep(s)` for `time.sleep(s)`), every ps and coordinator client registers a callback that
ends its calls in flight, and a loop that finds the task stopping raises `Stopped`, which unwinds
to `roles.run` through the `finally` blocks that close channels and servers.

Safe points: a loop checks the stop between steps; a push in flight gets `PUSH_GRACE_SECONDS` to
finish before its channels close (so it is applied on every ps or on none, unless a ps does not
answer meanwhile); no push starts once the task is stopping. A stopping chief never shuts the ps
tasks down (a replacement chief adopts their state) and never commits a checkpoint that is not
whole (a checkpoint exists only once its manifest does: `checkpoint.commit`).

A signal handler runs in the main thread between two bytecodes, possibly while that thread holds
a lock inside `threading.Event.wait`; setting an Event there can deadlock. The handler therefore
only records the signal and writes its number to a pipe; a watcher thread logs it, sets the
event and runs the callbacks. A task still running `FORCE_EXIT_SECONDS` after the signal (stuck
in a call nothing can interrupt, such as a long XLA compilation) exits at once with 128 + the
signal; further signals change nothing (`jaxps local` sends SIGTERM after a Ctrl-C's SIGINT).
A task with work to finish on SIGTERM (the preempted chief's last checkpoint) pushes that
backstop out with `Stop.hold`; SIGINT keeps it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

PUSH_GRACE_SECONDS = 1.0
FORCE_EXIT_SECONDS = 8.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """Unwinds a task's work once the task is stopping.

    A BaseException, as KeyboardInterrupt is: the `except Exception` paths that retry, roll the
    ps tier back or shut it down after a failure must not mistake a stop for a failure.
    """


class Stop:
    """Whether, and on which signal, this task was told to stop. Thread-safe.

    `mark` is all a signal handler may call; `request` (from any other thread, or a test) also
    wakes the waiters and runs the callbacks, each once. `is_set` is true from `mark` on, so the
    main thread sees its own signal at once, before the watcher thread has run.
    """

    def __init__(self) -> None:
        self._signal: signal.Signals | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._requested = False
        self._held = FORCE_EXIT_SECONDS  # the backstop after SIGTERM (`hold`)

    @property
    def received(self) -> signal.Signals | None:
        """The signal that stopped the task, if one did."""
        return self._signal

    @property
    def is_set(self) -> bool:
        return self._signal is not None

    @property
    def is_requested(self) -> bool:
        """Whether `request` ran: the waiters were woken and the callbacks run."""
        return self._requested

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process the signal killed: 143 for SIGTERM.
        The operator's ExitCode policy retries >= 128; a task told to stop did not finish."""
        return 128 + (self._signal or signal.SIGTERM)

    def hold(self, seconds: float) -> None:
        """Lets the task run up to `seconds` after a SIGTERM (never less than
        FORCE_EXIT_SECONDS) before the backstop ends it. Call it before the signal."""
        self._held = max(FORCE_EXIT_SECONDS, seconds)

    def backstop_seconds(self, signum: int) -> float:
        """How long after `signum` a task still running is ended (`install`)."""
        return self._held if signum == signal.SIGTERM else FORCE_EXIT_SECONDS

    def mark(self, signum: int) -> None:
        """Records the signal (the first one wins); safe in a signal handler: takes no lock."""
        if self._signal is None:
            self._signal = signal.Signals(signum)

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Stops the task: wakes every `wait` and `sleep`, then runs the callbacks, each once."""
        self.mark(signum)
        self._event.set()
        with self._lock:
            if self._requested:
                return
            self._requested = True
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        for callback in callbacks:
            _run(callback)

    def callback(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Runs `fn` once when the task is told to stop (now, if it already was); returns a
        function that unregisters it. Callbacks run on the watcher thread and must not block
        for long: they end calls in flight and stop servers."""
        with self._lock:
            if not self._requested:
                key = next(self._ids)
                self._callbacks[key] = fn
                return lambda: self._unregister(key)
        _run(fn)
        return lambda: None

    def _unregister(self, key: int) -> None:
        with self._lock:
            self._callbacks.pop(key, None)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits up to `timeout` seconds for the stop; whether the task is stopping."""
        return self.is_set or self._event.wait(timeout) or self.is_set

    def sleep(self, seconds: float) -> None:
        """`time.sleep` that raises `Stopped` as soon as the task is told to stop."""
        if self.wait(seconds):
            raise Stopped(f"stopping on {self.reason}")

    def check(self) -> None:
        """Raises `Stopped` if the task is stopping: call it at a loop's safe points."""
        if self.is_set:
            raise Stopped(f"stopping on {self.reason}")

    @property
    def reason(self) -> str:
        """What stopped the task, for logs: "SIGTERM"."""
        return self._signal.name if self._signal else "no signal"


def _run(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("while stopping")


def install(stop: Stop, *, signals: Iterable[signal.Signals] = SIGNALS) -> None:
    """Makes `signals` stop the task through `stop` (from the main thread, once per process)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def on_signal(signum: int, _frame: object) -> None:
        stop.mark(signum)
        with contextlib.suppress(OSError):  # a full pipe: the watcher has enough to read
            os.write(write_fd, bytes([signum]))

    def watch() -> None:
        while got := os.read(read_fd, 1):
            name = signal.Signals(got[0]).name
            if stop.is_requested:
                log.info("received %s again: already stopping", name)
                continue
            log.warning("received %s: stopping", name)
            seconds = stop.backstop_seconds(got[0])
            backstop = threading.Timer(seconds, _force_exit, args=(stop, seconds))
            backstop.daemon = True
            backstop.start()
            stop.request(got[0])

    threading.Thread(target=watch, name="stop-watcher", daemon=True).start()
    for signum in signals:
        signal.signal(signum, on_signal)


def _force_exit(stop: Stop, seconds: float) -> None:
    log.error(
        "still running %.0f s after %s: exiting now with %d",
        seconds,
        stop.reason,
        stop.exit_code,
    )
    os._exit(stop.exit_code)
