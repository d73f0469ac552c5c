"""Async mode: every gradient is applied on arrival, shard by shard, and counts one step.

An admitted push reserves one of the steps left before `Mode.last_step` until it counts or
fails, so that concurrent pushes never take the step past it. A push whose id counted before
(a retry) counts nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxps_runtime.ps.modes.policy import Push, PushResult, Store
from jaxps_runtime.wire import terms
from jaxps_runtime.wire.terms import Mode


class Async:
    applies_on_arrival = True

    def __init__(self, store: Store, mode: Mode, workers: Sequence[str]) -> None:
        self.store, self.mode = store, mode
        self.workers = tuple(workers)
        self._reserved = 0  # admitted pushes not counted yet; under store.lock

    def step_problem(self, step: int) -> str | None:
        """A worker pushes for the step it read, the lowest of every ps's (`PsClient.read`),
        so never for a step this ps has not reached; any older step is allowed (staleness)."""
        current = self.store.step
        if step > current:
            return (
                f"step {step} is ahead of this ps (at step {current}); a gradient is computed "
                f"at a step the ps has reached (at most {current})"
            )
        if step < 0:
            return f"step {step} is negative"
        return None

    def admit(self, step: int) -> PushResult | None:
        """Reserves the push a step. Never more pushes in flight than steps left before a
        snapshot asked for (a checkpoint): the pushes past it wait until it is taken, so its
        values hold exactly the updates its step and data positions count (an update applied
        on arrival but not counted yet would be in a fuzzy cut, and applied again after a
        rollback to it)."""
        with self.store.changed:
            while True:
                current = self.store.step
                save = self.store.next_save()
                if save is None or current + self._reserved < save or self._reserved == 0:
                    break
                self.store.changed.wait(timeout=0.5)  # the pushes in flight count (or fail)
            left = self.mode.last_step - current - self._reserved if self.mode.last_step else 1
            if left > 0:
                self._reserved += 1
                return None
        self.store.counters.add("pushes_rejected")
        return PushResult(False, current, f"{terms.OVER}: step {self.mode.last_step} reached")

    def release(self) -> None:
        with self.store.changed:
            self._reserved = max(self._reserved - 1, 0)
            self.store.changed.notify_all()

    def in_flight(self) -> int:
        return self._reserved

    def count(self, push: Push) -> PushResult:
        if push.idle:
            with self.store.changed:
                self._reserved = max(self._reserved - 1, 0)
                self.idle(push.worker)
                self.store.changed.notify_all()
                return PushResult(True, self.store.step, "idle: no data, no step")
        with self.store.lock:
            self._reserved = max(self._reserved - 1, 0)
            claims = [push.claim] if push.claim is not None else []
            counted, step = self.store.count_push(push.push_id, claims)
            if counted:
                self.counted(push.worker)
        if not counted:
            self.store.counters.add("pushes_duplicate")
            return PushResult(True, step, "duplicate push_id: already applied")
        self.store.counters.add("pushes_accepted")
        self.store.counters.set("staleness", float(max(step - 1 - push.step, 0)))
        return PushResult(True, step)

    def count_applied(self, worker: str, step: int) -> None:
        return None

    def idle(self, worker: str) -> None:
        """With store.lock held: `worker` has no data now."""

    def counted(self, worker: str) -> None:
        """With store.lock held, right after `worker`'s push counted."""

    def before_read(self, worker: str, *, is_active: Callable[[], bool]) -> None:
        return None

    def awaiting(self) -> int:
        return 0

    def set_workers(self, workers: Sequence[str]) -> None:
        with self.store.changed:
            self.workers = tuple(workers)
            self.store.changed.notify_all()
