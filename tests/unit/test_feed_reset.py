"""A worker's feed (`train.feed.Feed`) reset by a rollback: every lease it holds goes back to the
chief's queue, from where it got, whether it trains it or an ask in flight brings it back from
the restored queue (a dropped lease stays the worker's in the chief's queue and holds the
epoch's end forever); its reports of shards done survive; each ask says which lease it holds,
so that the chief can take back one it lost. The coordinator here is a stand-in that records
calls: this is a unit test of the feed's bookkeeping alone."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import pytest

from jaxps.v1 import coordinator_pb2 as co_pb2
from jaxps_runtime.train import feed as feed_module
from jaxps_runtime.train.coordinator import CoordinatorClient
from jaxps_runtime.train.feed import Feed


class Queue:
    """Answers asks with the shards of `shards` in turn (one batch each unless given), and
    holds the ask numbered `hold_at` until `release`."""

    def __init__(self, shards: list[co_pb2.ShardLease], *, hold_at: int = 0) -> None:
        self.shards = list(shards)
        self.hold_at = hold_at
        self.release = threading.Event()
        self.held = threading.Event()  # the held ask is with the chief
        self.calls: list[dict[str, Any]] = []
        self._asks = 0
        self._lock = threading.Lock()

    def lease(
        self,
        *,
        done: Sequence[int] = (),
        returned: Mapping[int, int] | None = None,
        want: bool = True,
        leaving: bool = False,
        wait_ms: int = 0,
        held: Sequence[int] = (),
        timeout: float = 10.0,
    ) -> co_pb2.LeaseReply:
        call = {"done": list(done), "returned": dict(returned or {}), "want": want}
        if want:
            call["held"] = list(held)
        with self._lock:
            self.calls.append(call)
        if not want:
            return co_pb2.LeaseReply()
        self._asks += 1
        if self._asks == self.hold_at:
            self.held.set()
            assert self.release.wait(10)
        if not self.shards:
            return co_pb2.LeaseReply(waiting="nothing")
        return co_pb2.LeaseReply(lease=self.shards.pop(0))

    def given_back(self) -> dict[int, int]:
        with self._lock:
            return {k: v for c in self.calls for k, v in c["returned"].items()}

    def reported_done(self) -> list[int]:
        with self._lock:
            return [d for c in self.calls for d in c["done"]]


def _until(what: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.01)


def _shard(lease: int, shard: int, first: int, end: int, start: int = 0) -> co_pb2.ShardLease:
    return co_pb2.ShardLease(lease=lease, shard=shard, first=first, end=end, start=start)


def test_a_lease_answered_after_a_reset_is_given_back_from_where_it_starts() -> None:
    # the second ask goes out ahead at the first shard's last batch, and is held; meanwhile the
    # ps tier rolls back, and the chief answers it with a lease of the restored queue
    queue = Queue([_shard(1, 0, 0, 1), _shard(7, 3, 96, 128, start=5)], hold_at=2)
    feed = Feed(cast(CoordinatorClient, queue), name="worker-0")
    try:
        position = feed.batch()
        assert position is not None
        assert position.lease == 1
        assert queue.held.wait(10)
        feed.reset()
        queue.release.set()
        _until(lambda: 7 in queue.given_back())
        assert queue.given_back() == {1: 0, 7: 5}
    finally:
        feed.close()


def test_the_lease_it_trains_when_it_learns_of_a_rollback_goes_back_from_where_it_got() -> None:
    # a lease the restored queue gave before the worker learnt of the rollback: the worker
    # trained 2 of its batches (from batch 3 of the shard on) when its push was refused
    queue = Queue([_shard(9, 2, 40, 50, start=3)])
    feed = Feed(cast(CoordinatorClient, queue), name="worker-0")
    try:
        for _ in range(2):
            at = feed.batch()
            assert at is not None
            assert at.lease == 9
            assert feed.settle([], step=0)
        feed.reset()
        _until(lambda: 9 in queue.given_back())
        assert queue.given_back() == {9: 5}
        assert feed.current is None
    finally:
        feed.close()


def test_each_ask_says_which_lease_it_holds() -> None:
    queue = Queue([_shard(1, 0, 0, 2), _shard(2, 1, 2, 4)])
    feed = Feed(cast(CoordinatorClient, queue), name="worker-0")
    try:
        assert feed.batch() is not None  # the first ask: it holds nothing
        assert feed.settle([], step=0)
        assert feed.batch() is not None  # the shard's last batch: the next ask, ahead
        _until(lambda: len(queue.calls) == 2)
        assert [c["held"] for c in queue.calls] == [[], [1]]
    finally:
        feed.close()


def test_reports_of_shards_done_outlive_a_reset() -> None:
    queue = Queue([_shard(1, 0, 0, 1), _shard(2, 1, 1, 2)])
    feed = Feed(cast(CoordinatorClient, queue), name="worker-0")
    try:
        for _ in range(2):
            assert feed.batch() is not None
            assert feed.settle([], step=0)
        # lease 1 is done, its report not sent yet (it rides on the next ask)
        _until(lambda: len(queue.calls) == 2)
        feed.reset()
        assert feed.batch() is None  # no shard left: the ask carries the report
        _until(lambda: 1 in queue.reported_done())
    finally:
        feed.close()


def test_a_reset_with_nothing_held_gives_nothing_back() -> None:
    queue = Queue([])
    feed = Feed(cast(CoordinatorClient, queue), name="worker-0")
    try:
        feed.reset()
        assert queue.calls == []
    finally:
        feed.close()


def test_a_worker_with_no_shard_says_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(feed_module, "_SAY_EVERY", 0.0)
    queue = Queue([])
    feed = Feed(cast(CoordinatorClient, queue), name="worker-3")
    try:
        with caplog.at_level(logging.WARNING, logger=feed_module.__name__):
            assert feed.batch() is None  # the first ask without a shard: it starts the clock
            _until(lambda: feed.batch() is None and "no shard" in caplog.text)
        assert "worker-3: no shard of the data for" in caplog.text
        assert "waiting for nothing" in caplog.text  # what the queue said
    finally:
        feed.close()
