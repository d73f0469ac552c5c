"""The operator's work queue: which jobs to reconcile next, and when to try a failed one again.

The queue keeps client-go's workqueue contract: a key is queued once however often it is
added; a key handed to a worker is never handed to a second one before `done`; a key added
during its pass runs once more after it; delayed adds are timers, the earliest winning. A pass
that fails is tried again after a delay that grows with each failure of that key (exponential,
with jitter so that keys failing together do not come back together: tenacity's
`wait_exponential_jitter`), up to a cap; a pass that succeeds, or the job's deletion, resets it.

Thread-safe, as client-go's is: the watch threads add keys and the worker threads take them,
one lock and one wake-up between an event and its pass (through an event loop it was two hops,
the loop's and a thread pool's, half a millisecond of a pod's phase reaching the job's
status). A worker waiting in `get` also fires the timers that are due; `shut_down` wakes every
worker with None.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import tenacity

Key = tuple[str, str]  # (namespace, name)


@dataclass
class Backoff:
    """Per-key delays before a failed pass is tried again: `initial` * 2**(n-1) plus up to
    `jitter` seconds at random after the nth failure in a row, never more than `cap`."""

    initial: float = 1.0
    cap: float = 60.0
    jitter: float = 1.0
    _retrying: tenacity.Retrying = field(init=False, repr=False)
    _failures: dict[Key, tenacity.RetryCallState] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        wait = tenacity.wait_exponential_jitter(
            multiplier=self.initial, max=self.cap, jitter=self.jitter
        )
        self._retrying = tenacity.Retrying(wait=wait)

    def failed(self, key: Key) -> float:
        """Counts one more failure of `key`; the delay before its next pass."""
        state = self._failures.get(key)
        if state is None:
            state = tenacity.RetryCallState(self._retrying, fn=None, args=(), kwargs={})
            self._failures[key] = state
        else:
            state.prepare_for_next_attempt()
        return float(self._retrying.wait(state))

    def failures(self, key: Key) -> int:
        """The failures of `key` in a row (0 after a success)."""
        state = self._failures.get(key)
        return 0 if state is None else state.attempt_number

    def reset(self, key: Key) -> None:
        """`key`'s next failure waits `initial` again."""
        self._failures.pop(key, None)


class WorkQueue:
    """Keys to reconcile: deduplicated, one pass per key at a time, delayed adds as timers,
    failed passes tried again with per-key exponential backoff."""

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff or Backoff()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: deque[Key] = deque()
        self._pending: set[Key] = set()
        self._active: set[Key] = set()
        self._again: set[Key] = set()
        self._timers: dict[Key, float] = {}  # key -> when its timer fires (time.monotonic)
        self._heap: list[tuple[float, Key]] = []  # the timers, stale entries included
        self._shut = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def add(self, key: Key) -> None:
        with self._lock:
            self._add(key)

    def _add(self, key: Key) -> None:
        if key in self._active:
            self._again.add(key)
        elif key not in self._pending:
            self._pending.add(key)
            self._queue.append(key)
            self._ready.notify()

    def add_after(self, key: Key, delay: float) -> None:
        """Adds `key` in `delay` seconds, unless an earlier timer is already set."""
        due = time.monotonic() + max(delay, 0.0)
        with self._lock:
            current = self._timers.get(key)
            if current is not None and current <= due:
                return
            self._timers[key] = due
            heapq.heappush(self._heap, (due, key))
            self._ready.notify()  # a waiting worker waits until this timer at most

    def retry(self, key: Key) -> float:
        """Adds `key` again after its pass failed, once its backoff delay is over (an earlier
        timer still wins); the delay."""
        with self._lock:
            delay = self.backoff.failed(key)
        self.add_after(key, delay)
        return delay

    def succeeded(self, key: Key) -> None:
        """`key`'s pass succeeded: its next failure starts the backoff over."""
        with self._lock:
            self.backoff.reset(key)

    def forget(self, key: Key) -> None:
        """The job is gone: no timer for it, no failures remembered."""
        with self._lock:
            self._timers.pop(key, None)  # its heap entry is stale now: skipped when due
            self.backoff.reset(key)

    def get(self, timeout: float | None = None) -> Key | None:
        """The next key, marked active until `done`; None once shut down, or after `timeout`
        seconds with nothing to hand out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._shut:
                now = self._fire(time.monotonic())
                if self._queue:
                    key = self._queue.popleft()
                    self._pending.discard(key)
                    self._active.add(key)
                    return key
                wake = self._heap[0][0] if self._heap else None
                if deadline is not None:
                    if now >= deadline:
                        return None
                    wake = deadline if wake is None else min(wake, deadline)
                self._ready.wait(None if wake is None else max(wake - now, 0.0))
            return None

    def _fire(self, now: float) -> float:
        """Adds the keys whose timers are due (the lock held); `now`."""
        while self._heap and self._heap[0][0] <= now:
            due, key = heapq.heappop(self._heap)
            if self._timers.get(key) == due:  # else replaced by an earlier one, or forgotten
                del self._timers[key]
                self._add(key)
        return now

    def done(self, key: Key) -> None:
        with self._lock:
            self._active.discard(key)
            if key in self._again:
                self._again.discard(key)
                self._add(key)

    def shut_down(self) -> None:
        """Every `get`, waiting or to come, answers None."""
        with self._lock:
            self._shut = True
            self._ready.notify_all()

    def tracked(self) -> set[Key]:
        """Every key queued, in a pass, or waiting on a timer."""
        with self._lock:
            return set(self._timers) | self._pending | self._active
