"""The operator's work queue: which jobs to reconcile next, and when to try a failed one again.

The queue keeps client-go's workqueue contract: a key is queued once however often it is
added; a key handed to a worker is never handed to a second one before `done`; a key added
during its pass runs once more after it; delayed adds are timers, the earliest winning. A pass
that fails is tried again after a delay that grows with each failure of that key (exponential,
with jitter so that keys failing together do not come back together: tenacity's
`wait_exponential_jitter`), up to a cap; a pass that succeeds, or the job's deletion, resets it.

Not thread-safe: the event loop alone calls it (passes run in threads, their outcomes come back
to the loop).
"""

from __future__ import annotations

import asyncio
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
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._pending: set[Key] = set()
        self._active: set[Key] = set()
        self._again: set[Key] = set()
        self._timers: dict[Key, tuple[float, asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, key: Key) -> None:
        if key in self._active:
            self._again.add(key)
        elif key not in self._pending:
            self._pending.add(key)
            self._queue.put_nowait(key)

    def add_after(self, key: Key, delay: float) -> None:
        """Adds `key` in `delay` seconds, unless an earlier timer is already set."""
        loop = asyncio.get_running_loop()
        due = loop.time() + max(delay, 0.0)
        current = self._timers.get(key)
        if current is not None and current[0] <= due and not current[1].cancelled():
            return
        if current is not None:
            current[1].cancel()

        def fire() -> None:
            self._timers.pop(key, None)
            self.add(key)

        self._timers[key] = (due, loop.call_at(due, fire))

    def retry(self, key: Key) -> float:
        """Adds `key` again after its pass failed, once its backoff delay is over (an earlier
        timer still wins); the delay."""
        delay = self.backoff.failed(key)
        self.add_after(key, delay)
        return delay

    def succeeded(self, key: Key) -> None:
        """`key`'s pass succeeded: its next failure starts the backoff over."""
        self.backoff.reset(key)

    def forget(self, key: Key) -> None:
        """The job is gone: no timer for it, no failures remembered."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()
        self.backoff.reset(key)

    async def get(self) -> Key:
        key = await self._queue.get()
        self._pending.discard(key)
        self._active.add(key)
        return key

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key)

    def tracked(self) -> set[Key]:
        """Every key queued, in a pass, or waiting on a timer."""
        return set(self._timers) | self._pending | self._active
