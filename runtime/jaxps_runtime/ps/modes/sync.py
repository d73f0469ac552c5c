"""Sync mode: the gradients of one step, one per live worker (or `replicas_to_aggregate`), are
summed in place as they come; the last one seals the step and applies the mean to every shard,
then the step advances with the contributors' data positions. The mean is over the gradients
that carried data: a worker with no batch this step (the data epoch is ending) or whose batch
this ps applied already still counts as one of the step's gradients, adding nothing. A gradient
for a step that moved on, or that is being applied, is refused as stale (as backup workers'
are: the worker computes its batch again at the new step); a second one from the same worker
for the same step is a duplicate and adds nothing. A push the servicer refused (a gradient that
is not finite) never reaches `count`: it adds nothing to the step, which the other workers'
gradients complete.

The live workers change between steps: a worker gone is dropped at once (the step must not wait
for it), a worker that joins is waited for from the next step on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxps_runtime.ps.modes.policy import PsError, Push, PushResult, Store
from jaxps_runtime.ps.positions import Claim
from jaxps_runtime.wire import terms
from jaxps_runtime.wire.terms import Mode

log = logging.getLogger(__name__)


class Sync:
    applies_on_arrival = False

    def __init__(self, store: Store, mode: Mode, workers: Sequence[str]) -> None:
        self.store, self.mode = store, mode
        self.workers = tuple(workers)
        self._joining: tuple[str, ...] | None = None  # the live set from the next step on
        # The running sums of the current step, who contributed them (with the batch each
        # push claimed, whose position moves when the step is applied), how many brought
        # gradients, and whether the step is sealed (being applied). Guarded by `_lock`, taken
        # before store.lock when both are needed.
        self._lock = threading.Lock()
        self._sums: dict[str, np.ndarray] = {}
        self._contributors: dict[str, Claim | None] = {}
        self._with_data = 0
        self._sealed = False

    def _expected(self) -> int:
        """The gradients a step waits for: one per live worker, or `replicas_to_aggregate` of
        them while that many live (never more: a step never waits on a worker that is gone)."""
        live = len(self.workers)
        wanted = self.mode.replicas_to_aggregate
        return max(1, min(wanted, live) if wanted and live else wanted or live)

    def step_problem(self, step: int) -> str | None:
        """Sync aggregates the current step's gradients only: an older step is stale (`admit`
        refuses it as such), a later one cannot have been read from this ps yet."""
        current = self.store.step
        if step > current:
            return (
                f"step {step} is ahead of this ps (at step {current}); sync takes gradients "
                f"of the current step {current} only"
            )
        if step < 0:
            return f"step {step} is negative"
        return None

    def admit(self, step: int) -> PushResult | None:
        current = self.store.step
        if self.mode.last_step and current >= self.mode.last_step:
            self.store.counters.add("pushes_rejected")
            return PushResult(False, current, f"{terms.OVER}: step {self.mode.last_step} reached")
        if step != current:
            self.store.counters.add("pushes_stale")
            return PushResult(False, current, f"stale: computed at step {step}, ps is at {current}")
        return None

    def release(self) -> None:
        return None

    def in_flight(self) -> int:
        return 1 if self._sealed else 0

    def count(self, push: Push) -> PushResult:
        contributor = push.worker or push.push_id
        with self._lock:
            current = self.store.step
            if push.step != current or self._sealed:
                self.store.counters.add("pushes_stale")
                self.store.drop(push.claim)
                return PushResult(
                    False, current, f"stale: computed at step {push.step}, step {current} is closed"
                )
            if contributor in self._contributors:
                self.store.counters.add("pushes_duplicate")
                self.store.drop(push.claim)
                return PushResult(True, current, "duplicate: already aggregated for this step")
            for name, (held, grad) in push.dense.items():
                total = self._sums.get(name)
                if total is None:  # the first gradient's buffer becomes the sum
                    self._sums[name] = grad if grad.flags.writeable else grad.copy()
                else:
                    np.add(total, grad, out=total)
                    held.recycle(grad)
            self._contributors[contributor] = push.claim
            self._with_data += 1 if push.dense else 0
            self.store.counters.add("pushes_accepted")
            ready = self._seal_if_complete()
        if ready is not None:
            return PushResult(True, self._apply_mean(*ready))
        return PushResult(True, current)

    def count_applied(self, worker: str, step: int) -> None:
        with self._lock:
            if step != self.store.step or self._sealed or not worker:
                return
            if worker in self._contributors:
                return
            self._contributors[worker] = None
            ready = self._seal_if_complete()
        if ready is not None:
            self._apply_mean(*ready)

    def _seal_if_complete(
        self,
    ) -> tuple[dict[str, np.ndarray], dict[str, Claim | None], int] | None:
        """With `_lock` held: takes the sums and their contributors out once enough are in."""
        count = len(self._contributors)
        if count == 0 or count < self._expected():
            return None
        sums, self._sums = self._sums, {}
        contributors, self._contributors = self._contributors, {}
        with_data, self._with_data = self._with_data, 0
        self._sealed = True
        return sums, contributors, with_data

    def _apply_mean(
        self, sums: dict[str, np.ndarray], contributors: Mapping[str, Claim | None], with_data: int
    ) -> int:
        """Applies the mean to every shard, then opens the next step with the contributors'
        data positions; returns it. The step opens also when a shard's update was refused as
        not finite (that shard keeps its values; the PsError goes on to the caller): a refused
        update never holds the step shut."""
        who = f"the mean of step {self.store.step} from {', '.join(sorted(contributors))}"
        pending = []
        for name, total in sums.items():
            np.divide(total, max(with_data, 1), out=total)
            held = self.store.find(name)
            if held is not None:
                pending.append(self.store.apply_dense(held, total, push_id="", who=who))
        try:
            self.store.settle(pending)
        finally:
            with self._lock:
                claims = [c for c in contributors.values() if c is not None]
                self._sealed = False  # counted now: a snapshot at this step is exact
                _, step = self.store.count_push("", claims)
                if self._joining is not None:
                    self.workers, self._joining = self._joining, None
        return step

    def before_read(self, worker: str, *, is_active: Callable[[], bool]) -> None:
        return None

    def awaiting(self) -> int:
        with self._lock:
            return max(self._expected() - len(self._contributors), 0)

    def set_workers(self, workers: Sequence[str]) -> None:
        """Sync may now have enough gradients for the step. Workers gone are dropped now;
        workers that joined are waited for from the next step on (at once when no gradient
        of the current step is in yet)."""
        with self._lock:
            with self.store.changed:
                new = tuple(workers)
                if set(new) - set(self.workers) and self._contributors:
                    self.workers = tuple(w for w in self.workers if w in new)
                    self._joining = new
                else:
                    self.workers, self._joining = new, None
                self.store.changed.notify_all()
            ready = self._seal_if_complete()
        if ready is None:
            return
        try:
            self._apply_mean(*ready)
        except PsError as err:  # the chief changed the workers: the refusal is the ps's to log
            log.warning("%s: step applied after the workers changed: %s", self.store.task, err)
