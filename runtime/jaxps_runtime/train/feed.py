"""A worker's data: the shard it leased from the chief's queue, the batch it is at, the next
shard asked for ahead of time so that asking costs no step.

    feed.batch() -> Position (train it) or None (no shard now: the epoch is ending);
                    raises TrainingOverError once the queue leases nothing more
    feed.wait(s)    with no shard: waits up to s seconds for one (back as soon as it is in)
    feed.settle(replies)  the ps's answers to its push: the next batch, the same again, or
                    another shard (a ps took the lease back)
    feed.reset()    the ps tier was rolled back: the leases it holds go back to the queue
    feed.leave(...) give every lease back and leave the job (the worker drains)

Not thread-safe: the worker's loop only; the one background thread it starts only asks the chief
for the next shard. Shards done ride on the next ask (no call of their own): the chief learns of
them a shard late, except at an epoch's end, where every ask carries them at once. Each ask also
says which lease the worker holds, so that the chief takes back one the worker lost (a reply
that never came, a lease dropped on a rollback learnt of late) instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import Any

import grpc

from jaxps.v1 import coordinator_pb2 as co_pb2
from jaxps_runtime.train.coordinator import CoordinatorClient
from jaxps_runtime.wire import terms

log = logging.getLogger(__name__)


# The batch is in on that ps, or never will be (past its last step: it takes nothing more).
_IN = frozenset({"", terms.APPLIED, "duplicate", terms.OVER})
_LOST = frozenset({terms.REVOKED, terms.GAP})  # the lease is someone else's now
_NOT_COUNTED = frozenset({terms.REVOKED, terms.GAP, terms.BUSY})


def refused_position(replies: list[Any]) -> bool:
    """A ps refused the push for its data position, not as applied: it did not count there."""
    return any(not r.accepted and terms.refusal_word(r.reason) in _NOT_COUNTED for r in replies)


_POLL_MS = 1000  # how long the chief may hold an ask at an epoch's end (see MAX_LEASE_WAIT_MS)
_AGAIN = 0.02  # seconds between asks that found no shard
_HELD = 0.05  # ... while the chief brings the ps tier up, or is away
_SAY_EVERY = 30.0  # seconds between log lines while a worker has no shard


@dataclass
class _Asked:
    """One ask of the chief's queue, done in the background: its reply or error, and the
    shards done it reported (reported again with the next ask if it failed)."""

    done: list[int]
    reply: co_pb2.LeaseReply | None = None
    error: grpc.RpcError | None = None
    polled: bool = field(default=False)


class TrainingOverError(Exception):
    """The queue leases nothing more: training is over."""


@dataclass(frozen=True)
class Position:
    """One batch to train: which (epoch, batch index in the epoch's order), the shard it is in
    and the shard's position once it is applied; `skip`: push it without gradients."""

    epoch: int
    batch: int
    shard: str
    cursor: int
    lease: int
    skip: bool


class Feed:
    def __init__(self, coordinator: CoordinatorClient, *, name: str) -> None:
        self._coordinator = coordinator
        self._name = name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-feed")
        self.current: co_pb2.ShardLease | None = None
        self.at = 0  # the batch of `current` next, in its epoch's order
        self._ahead: Future[_Asked] | None = None  # the ask in flight
        self._done: list[int] = []  # leases applied, not reported yet
        self._ending = False  # the last answer: the epoch's last shards are others'
        self._next_ask = 0.0  # (monotonic) no ask before then
        self.waiting = ""  # why there is no shard now
        self.hold = False  # and whether that is the chief bringing the ps tier up
        self.epoch = 0
        self._counted = False  # its first gradient applied: logged once
        self._asking: list[int] = []  # the done reports the ask in flight carries
        self._without: float | None = None  # (monotonic) since when it has had no shard
        self._said = 0.0  # (monotonic) when it last said so

    def batch(self) -> Position | None:
        """The batch to train now; None when the queue has none for this worker right now."""
        if self.current is None or self.at >= self.current.end:
            if self.current is not None:
                self._done.append(self.current.lease)
                self.current = None
            self.current = self._take()
            if self.current is None:
                self._say_waiting()
                return None
            self._without = None
            self.at = self.current.first + self.current.start
            log.debug(
                "%s: shard %d of epoch %d (lease %d) from batch %d",
                self._name,
                self.current.shard,
                self.current.epoch,
                self.current.lease,
                self.at,
            )
            if self.at >= self.current.end:
                return self.batch()
        lease = self.current
        if self.at == lease.end - 1 and self._ahead is None:  # the last batch: ask ahead
            self._ahead = self._submit(poll=False)
        return Position(
            epoch=lease.epoch,
            batch=self.at,
            shard=terms.shard_key(lease.epoch, lease.shard),
            cursor=self.at - lease.first + 1,
            lease=lease.lease,
            skip=self.at in lease.skip,
        )

    def wait(self, seconds: float) -> None:
        """With no shard: waits up to `seconds` for the ask in flight to be answered, or until
        the next ask is due."""
        ahead = self._ahead
        if ahead is not None:
            wait_for([ahead], timeout=seconds)
        else:
            time.sleep(max(0.0, min(seconds, self._next_ask - time.monotonic())))

    def settle(self, replies: list[Any], *, step: int) -> bool:
        """The ps's replies to the push of the current batch (`FrameHeader`s). True, and on to
        the next batch, when every ps has it in (applied now or before); the lease dropped when
        a ps says the shard is someone else's now; else the batch is pushed again (a sync step
        closed without it, or another push of it was in flight)."""
        words = {terms.refusal_word(r.reason) if not r.accepted else "" for r in replies}
        if words <= _IN:
            self.at += 1
            if not self._counted:
                self._counted = True
                log.info("%s: its first gradient is applied (step %d)", self._name, step)
            return True
        if terms.GAP in words and self.current is not None:  # a ps has less than the lease
            # said: the shard goes back to the queue, to go on from where the ps tier has it
            log.warning("%s: shard %s is behind on a ps: giving it back", self._name, self._key())
            self._pool.submit(self._give_back, {self.current.lease: -1})
            self.current = None
        elif words & _LOST:
            log.info("%s: lease of shard %s was taken back", self._name, self._key())
            self.current = None
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s: batch %d again: %s", self._name, self.at, sorted(words))
        return False

    def reset(self) -> None:
        """The ps tier was brought up again at a new epoch: the queue starts over from the ps
        tier's positions. Every lease the worker holds goes back, from where it got: one of the
        queue before is void there and ignored, but the one it trains may be of the restored
        queue already (asked between the restore and this worker's learning of it), and the
        queue would wait for it forever at the epoch's end. So does a lease an ask already sent
        brings back (the chief answers a held ask as soon as it restores the queue). Reports of
        leases done stay: the queue ignores those it no longer knows."""
        current, self.current, self._ending = self.current, None, False
        if current is not None:
            with contextlib.suppress(RuntimeError):  # closed: the chief reclaims it
                self._pool.submit(self._give_back, {current.lease: self.at - current.first})
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        if ahead.cancel():  # never sent: its reports ride on the next ask
            self._done = self._asking + self._done
        else:  # sent already: see what it brings
            ahead.add_done_callback(self._unused)

    def _unused(self, ahead: Future[_Asked]) -> None:
        """Gives back the lease an ask answered after a reset brought, if any, with the reports
        of an ask that failed."""
        if ahead.cancelled():
            return
        asked = ahead.result()
        returned = {}
        if asked.reply is not None and asked.reply.HasField("lease"):
            returned[asked.reply.lease.lease] = asked.reply.lease.start
        done = asked.done if asked.error is not None else []
        if returned or done:
            with contextlib.suppress(RuntimeError):  # closed meanwhile: the chief reclaims it
                self._pool.submit(self._give_back, returned, done)

    def leave(self, coordinator: CoordinatorClient) -> None:
        """Gives every lease back (the current one from the batch it is at) and leaves, over
        `coordinator`, which it closes."""
        returned: dict[int, int] = {}
        done = list(self._done)
        if self.current is not None:
            returned[self.current.lease] = self.at - self.current.first
        ahead = self._ahead
        if ahead is not None and ahead.done() and not ahead.cancelled():
            asked = ahead.result()
            done += asked.done if asked.reply is None else []
            if asked.reply is not None and asked.reply.HasField("lease"):
                returned[asked.reply.lease.lease] = asked.reply.lease.start
        try:
            coordinator.lease(done=done, returned=returned, want=False, leaving=True)
            log.info("%s: gave back %d leases and left the job", self._name, len(returned))
        except grpc.RpcError as err:
            log.warning("%s: could not give its leases back: %s", self._name, err.details())
        finally:
            coordinator.close()
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- asking the chief ----------------------------------------------------------------------

    def _key(self) -> str:
        c = self.current
        return terms.shard_key(c.epoch, c.shard) if c is not None else "-"

    def _submit(self, *, poll: bool) -> Future[_Asked]:
        """Asks for the next shard in the background, reporting the shards done so far and the
        lease it holds; `poll`: the chief holds the ask until a shard is free (the epoch's
        end)."""
        done, self._done = self._done, []
        self._asking = done
        held = [self.current.lease] if self.current is not None else []
        return self._pool.submit(self._ask, done, poll, held)

    def _take(self) -> co_pb2.ShardLease | None:
        """The next shard, or None (why in `waiting`). Blocks on an ask that is answered at
        once; an ask held at the epoch's end is only looked at (a sync worker pushes its idle
        share meanwhile)."""
        if self._ahead is None:
            if time.monotonic() < self._next_ask:
                return None
            self._ahead = self._submit(poll=self._ending)
        ahead = self._ahead
        if ahead.cancelled():  # at shutdown
            self._ahead = None
            return None
        if self._ending and not ahead.done():
            return None
        asked = ahead.result()
        self._ahead = None
        if asked.error is not None:  # the chief is away (restarting): ask again later
            self._done = asked.done + self._done
            self.waiting = f"the chief's shard queue to answer ({asked.error.code().name})"
            self.hold, self._ending = True, False
            self._next_ask = time.monotonic() + _HELD
            return None
        reply = asked.reply
        assert reply is not None
        self.epoch = reply.epoch
        if reply.over:
            raise TrainingOverError(reply.waiting)
        if not reply.HasField("lease"):
            self.waiting, self.hold = reply.waiting, reply.hold
            again = self._ending and asked.polled  # a held ask: ask again at once
            self._ending = not reply.hold
            if not self._ending:
                self._next_ask = time.monotonic() + _HELD
            elif not again:  # the first ask that found the epoch ending: hold the next one
                return self._take()
            else:
                self._next_ask = time.monotonic() + _AGAIN
            return None
        self.waiting, self._ending = "", False
        return reply.lease

    def _say_waiting(self) -> None:
        """Logs what the worker waits for when it has had no shard for a while, and again
        every so often: a wait for data is never silent."""
        now = time.monotonic()
        if self._without is None:
            self._without = self._said = now
        elif now - self._said >= _SAY_EVERY:
            self._said = now
            log.warning(
                "%s: no shard of the data for %.0f s: waiting for %s",
                self._name,
                now - self._without,
                self.waiting or "the chief's shard queue to answer",
            )

    def _give_back(self, returned: dict[int, int], done: Sequence[int] = ()) -> None:
        try:
            self._coordinator.lease(done=done, returned=returned, want=False)
        except grpc.RpcError as err:  # the chief takes it back when it finds the worker gone
            log.warning("%s: could not give a lease back: %s", self._name, err.details())

    def _ask(self, done: list[int], poll: bool, held: list[int]) -> _Asked:
        try:
            reply = self._coordinator.lease(
                done=done, want=True, wait_ms=_POLL_MS if poll else 0, held=held
            )
        except grpc.RpcError as err:
            return _Asked(done=done, error=err)
        return _Asked(done=done, reply=reply, polled=poll)
