"""The job's one shard queue, held by the chief: which shard of the data each worker trains on.

Each data epoch is cut into shards (`data.shards.ShardPlan`); a worker asks for one (`lease`),
trains its batches in order, and reports it `done` once every batch's gradients are applied on
every ps. A worker that leaves gives its leases back with how far it got (`give_back`); a worker
that died or restarted has them taken back (`reclaim`), from the position the ps tier reports
for the shard (the lowest over the ps: a ps that applied more refuses those batches as
"applied", `ps.positions`). Either way the shard goes on from where it stopped, never from its
start, with a new lease id: a ps refuses pushes of the old lease once the new one pushed.

The queue keeps nothing the ps tier does not hold: the ps record each shard's position with the
update that moves it, so every checkpoint holds the queue's state with the parameters it
matches, and `restore` rebuilds the queue from the positions the ps hold after any bring-up
(adopted, restored or initialised). An epoch starts only once every shard of the one before is
done, so epochs never overlap and each record is applied once per epoch.

Thread-safe (one lock): the Coordinator's threads call `lease`, `done` and `give_back`, the
chief's watch `reclaim` and `restore`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.wire import terms

log = logging.getLogger(__name__)

_MAX_WAITERS = 8  # of the chief's 16 RPC threads


@dataclass(frozen=True)
class Lease:
    """One shard leased to one worker: its batches [first, end), from first + start on."""

    lease: int
    worker: str
    epoch: int
    shard: int
    first: int
    end: int
    start: int
    skip: tuple[int, ...] = ()  # batches that diverged before: pushed without gradients

    @property
    def key(self) -> str:
        return terms.shard_key(self.epoch, self.shard)


@dataclass(frozen=True)
class Answer:
    """What `lease` says: a lease, or why there is none now (`over`: never again)."""

    lease: Lease | None = None
    waiting: str = ""
    over: bool = False
    hold: bool = False  # the chief brings the ps tier up: nothing to do, not even an idle share


@dataclass(frozen=True)
class Counts:
    """The queue at a glance (metrics, status, logs)."""

    epoch: int
    shards: int  # per epoch; 0 for a stream
    done: int
    leased: int
    reclaimed: int


class ShardQueue:
    def __init__(self, plan: ShardPlan, *, first_lease: int | None = None) -> None:
        self.plan = plan
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a shard done, given or taken back
        self._waiters = 0  # Lease calls held now (each holds one of the chief's RPC threads)
        # Lease ids grow over the job's life, across chief restarts: a new chief starts above
        # any id an earlier one gave (microseconds since the epoch of the clock).
        self._next_lease = first_lease if first_lease is not None else time.time_ns() // 1000
        self._ready = False
        self._over = False
        self._epoch = 0
        self._applied: dict[int, int] = {}  # shard -> batches applied on every ps (known)
        self._done: set[int] = set()
        self._todo: list[int] = []  # shards free to lease, lowest first
        self._fresh = 0  # streams: the next shard never leased
        self._leases: dict[int, Lease] = {}
        self._reclaimed = 0
        self._observed: dict[str, int] = {}  # the ps tier's positions, as last observed
        self._skip: set[tuple[int, int]] = set()  # (epoch, batch) that diverged
        self._left: set[str] = set()  # workers that left the job: leased nothing more

    # --- the chief ---------------------------------------------------------------------------

    def restore(self, positions: Mapping[str, int]) -> None:
        """Starts over from the data positions the ps tier holds (the lowest over the ps, by
        `terms.shard_key`): the newest epoch among them, each shard of it as far as it got.
        Every lease given before is void (the ps tier was brought up at a new cluster epoch)."""
        parsed = {
            p: int(v) for k, v in positions.items() if (p := terms.parse_shard_key(k)) is not None
        }
        epoch = max((e for e, _ in parsed), default=0)
        with self._lock:
            self._leases.clear()
            self._observed = dict(positions)
            self._over = False  # rolled back below the last step: training goes on
            self._start_epoch(epoch, {s: v for (e, s), v in parsed.items() if e == epoch})
            self._ready = True
            if self._epoch_complete():
                self._start_epoch(self._epoch + 1, {})
            self._changed.notify_all()
        log.info("shard queue at data epoch %d: %s", self._epoch, self._describe())

    def hold(self) -> None:
        """The chief rolls the ps tier back: nothing is leased until `restore`."""
        with self._lock:
            self._ready = False
            self._changed.notify_all()

    def skip(self, epoch: int, batch: int) -> None:
        """Batch `batch` of data epoch `epoch` diverged (training.onDivergence: rollback): its
        holders push it without gradients from now on."""
        with self._lock:
            self._skip.add((epoch, batch))

    def finish(self) -> None:
        """Training is over: nothing more is leased."""
        with self._lock:
            self._over = True
            self._changed.notify_all()

    def observe(self, positions: Mapping[str, int]) -> None:
        """The ps tier's data positions (the lowest over the ps), as the chief last saw them."""
        with self._lock:
            self._observed = dict(positions)

    def reclaim(self, worker: str) -> list[Lease]:
        """Takes back every lease of `worker` (dead, restarted or gone); each shard goes on from
        the position last observed on the ps tier (`observe`) or what the queue knew, whichever
        is further: a batch applied since is refused as "applied" by the ps that have it."""
        with self._lock:
            taken = self._take_back(worker, keep=frozenset())
        self._say_taken(worker, taken, "")
        return taken

    def leave(self, worker: str) -> list[Lease]:
        """`worker` left the job (scaled down, drained): its leases are taken back, and nothing
        more is leased to it, not even to an ask of it still held here at an epoch's end (it
        would never train that shard, and the epoch could not end), until it `join`s again."""
        with self._lock:
            self._left.add(worker)
            taken = self._take_back(worker, keep=frozenset())
        self._say_taken(worker, taken, " (it left the job)")
        return taken

    def join(self, worker: str) -> None:
        """`worker` registered (again): it may lease shards."""
        with self._lock:
            self._left.discard(worker)

    def holders(self) -> set[str]:
        with self._lock:
            return {lease.worker for lease in self._leases.values()}

    def counts(self) -> Counts:
        with self._lock:
            return Counts(
                epoch=self._epoch,
                shards=self.plan.shards or 0,
                done=len(self._done),
                leased=len(self._leases),
                reclaimed=self._reclaimed,
            )

    # --- the workers -------------------------------------------------------------------------

    def lease(
        self, worker: str, *, wait: float = 0.0, held: Collection[int] | None = None
    ) -> Answer:
        """The next shard for `worker`, or why there is none now. With `wait` (seconds), while
        the epoch's last shards are leased to others, waits up to that long for one to be free
        or the next epoch to start (a worker idle at an epoch's end gets its shard at once).

        `held`: the leases the worker says it holds. Any other of its leases is taken back
        first, as `reclaim` would: the worker lost it (a reply it never got, a lease it dropped
        on a rollback it learnt of late), and the epoch could not end while it stayed out."""
        deadline = time.monotonic() + wait
        taken: list[Lease] = []
        try:
            with self._lock:
                if held is not None:
                    taken = self._take_back(worker, keep=frozenset(held))
                return self._wait_lease(worker, deadline)
        finally:
            self._say_taken(worker, taken, " (it no longer holds it)")

    def _wait_lease(self, worker: str, deadline: float) -> Answer:
        """`lease`'s wait, with the lock held."""
        while True:
            answer = self._lease(worker)
            left = deadline - time.monotonic()
            if answer.lease is not None or answer.over or answer.hold or left <= 0:
                return answer
            if self._waiters >= _MAX_WAITERS:  # the chief's RPC threads are for others too
                return answer
            self._waiters += 1
            try:
                self._changed.wait(left)
            finally:
                self._waiters -= 1

    def _lease(self, worker: str) -> Answer:
        """`lease` without waiting, with the lock held."""
        if self._over:
            return Answer(waiting="training is over", over=True)
        if worker in self._left:
            return Answer(waiting="nothing: it left the job", over=True)
        if not self._ready:
            return Answer(waiting="the chief to bring the ps tier up", hold=True)
        if not self._todo and self._epoch_complete():
            self._start_epoch(self._epoch + 1, {})
            log.info("data epoch %d starts: %s", self._epoch, self._describe())
        if not self._todo and self.plan.shards is None:
            self._todo.append(self._fresh)
            self._fresh += 1
        if not self._todo:
            return Answer(waiting=f"data epoch {self._epoch} to end: {self._describe_leased()}")
        shard = self._todo.pop(0)
        first, end = self.plan.span(shard)
        lease = Lease(
            lease=self._next_lease,
            worker=worker,
            epoch=self._epoch,
            shard=shard,
            first=first,
            end=end,
            start=self._applied.get(shard, 0),
            skip=tuple(sorted(b for e, b in self._skip if e == self._epoch and first <= b < end)),
        )
        self._next_lease += 1
        self._leases[lease.lease] = lease
        return Answer(lease=lease)

    def done(self, worker: str, leases: Iterable[int]) -> None:
        """`worker`'s shards of `leases` are applied on every ps. A lease taken back meanwhile
        is ignored: the shard's new holder reports it."""
        with self._lock:
            for id_ in leases:
                lease = self._leases.get(id_)
                if lease is None or lease.worker != worker:
                    continue
                del self._leases[id_]
                self._applied[lease.shard] = lease.end - lease.first
                self._done.add(lease.shard)
                self._changed.notify_all()

    def give_back(self, worker: str, returned: Mapping[int, int]) -> None:
        """`worker` leaves: its leases ({lease: batches of its shard applied on every ps}) go
        back to the queue, each shard from where it got (a negative count: from where the ps tier
        has it, as last observed)."""
        with self._lock:
            for id_, count in returned.items():
                lease = self._leases.get(id_)
                if lease is None or lease.worker != worker:
                    continue
                del self._leases[id_]
                applied = count
                if count < 0:  # the holder does not know: as the ps tier has it
                    applied = self._observed.get(lease.key, 0)
                    self._applied[lease.shard] = min(self._applied.get(lease.shard, 0), applied)
                    lease = dataclasses.replace(lease, start=applied)
                self._back(lease, applied)
                self._changed.notify_all()

    # --- with the lock held ------------------------------------------------------------------

    def _take_back(self, worker: str, *, keep: frozenset[int]) -> list[Lease]:
        """`worker`'s leases but those in `keep`, taken back: each shard free again from where
        the ps tier was last seen to have it (or the queue knew, whichever is further)."""
        taken = [
            lease
            for lease in self._leases.values()
            if lease.worker == worker and lease.lease not in keep
        ]
        for lease in taken:
            del self._leases[lease.lease]
            self._back(lease, self._observed.get(lease.key, 0))
            self._reclaimed += 1
        if taken:
            self._changed.notify_all()
        return taken

    def _say_taken(self, worker: str, taken: list[Lease], why: str) -> None:
        for lease in taken:
            log.warning(
                "took back shard %s from %s (lease %d)%s: it goes on from batch %d of %d",
                lease.key,
                worker,
                lease.lease,
                why,
                self._applied.get(lease.shard, 0),
                lease.end - lease.first,
            )

    def _describe_leased(self) -> str:
        """Who holds the shards the epoch's end waits for (a worker's log says it)."""
        holders: dict[str, list[str]] = {}
        for lease in sorted(self._leases.values(), key=lambda x: x.shard):
            holders.setdefault(lease.worker, []).append(str(lease.shard))
        named = "; ".join(
            f"{w}: shard{'s' if len(shards) > 1 else ''} {', '.join(shards)}"
            for w, shards in sorted(holders.items())
        )
        n = len(self._leases)
        return f"its last {n} shard{'s are' if n != 1 else ' is'} still leased ({named})"

    def _start_epoch(self, epoch: int, applied: Mapping[int, int]) -> None:
        self._epoch = epoch
        self._applied = dict(applied)
        total = self.plan.shards
        if total is None:  # a stream: shards are leased in order, so every one below the
            # highest a push reached was leased; those not complete go on, then fresh ones
            self._fresh = max(applied, default=-1) + 1
            self._done = {
                s for s in range(self._fresh) if applied.get(s, 0) >= self._span_length(s)
            }
            self._todo = [s for s in range(self._fresh) if s not in self._done]
            return
        self._done = {s for s in range(total) if applied.get(s, 0) >= self._span_length(s)}
        self._todo = [s for s in range(total) if s not in self._done]

    def _span_length(self, shard: int) -> int:
        first, end = self.plan.span(shard)
        return end - first

    def _epoch_complete(self) -> bool:
        total = self.plan.shards
        return total is not None and len(self._done) >= total and not self._leases

    def _back(self, lease: Lease, applied: int) -> None:
        """A shard no longer leased and not known done: free again, from where it got."""
        if lease.epoch != self._epoch or lease.shard in self._done:
            return
        at = max(self._applied.get(lease.shard, 0), applied, lease.start)
        if at >= lease.end - lease.first:
            self._applied[lease.shard] = at
            self._done.add(lease.shard)
            return
        self._applied[lease.shard] = at
        if lease.shard not in self._todo:
            self._todo.append(lease.shard)
            self._todo.sort()

    def _describe(self) -> str:
        total = self.plan.shards
        if total is None:
            return f"a stream of shards of {self.plan.shard_batches} batches"
        return (
            f"{len(self._done)} of {total} shards done ({self.plan.shard_batches} batches of "
            f"{self.plan.batch_size} each)"
        )
