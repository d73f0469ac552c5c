"""A worker's feed (`train.feed.Feed`) reset by a rollback while an ask is in flight: the lease
that ask brings back from the restored queue is given back, not dropped (a dropped lease stays
the worker's in the chief's queue and holds the epoch's end forever). The coordinator here is a
stand-in that records calls: this is a unit test of the feed's bookkeeping alone."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

from jaxps.v1 import coordinator_pb2 as co_pb2
from jaxps_runtime.train.coordinator import CoordinatorClient
from jaxps_runtime.train.feed import Feed


class Queue:
    """Answers the first ask with a one-batch shard, holds the second until `release`."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[dict[str, Any]] = []
        self.given_back = threading.Event()
        self.held = threading.Event()  # the second ask is with the chief

    def lease(
        self,
        *,
        done: Sequence[int] = (),
        returned: Mapping[int, int] | None = None,
        want: bool = True,
        leaving: bool = False,
        wait_ms: int = 0,
        timeout: float = 10.0,
    ) -> co_pb2.LeaseReply:
        self.calls.append({"done": list(done), "returned": dict(returned or {}), "want": want})
        if returned:
            self.given_back.set()
            return co_pb2.LeaseReply()
        if len(self.calls) == 1:
            return co_pb2.LeaseReply(lease=co_pb2.ShardLease(lease=1, shard=0, first=0, end=1))
        self.held.set()
        assert self.release.wait(10)
        # a lease of the queue as the chief restored it after the rollback
        shard = co_pb2.ShardLease(lease=7, shard=3, first=96, end=128, start=5)
        return co_pb2.LeaseReply(lease=shard)


def test_a_lease_answered_after_a_reset_is_given_back_from_where_it_starts() -> None:
    queue = Queue()
    feed = Feed(cast(CoordinatorClient, queue), name="worker-0")
    try:
        position = feed.batch()  # the shard's last batch: the next ask goes out ahead
        assert position is not None
        assert position.lease == 1
        assert queue.held.wait(10)
        feed.reset()  # the ps tier rolled back while that ask was in flight
        queue.release.set()
        assert queue.given_back.wait(10), queue.calls
        assert queue.calls[-1] == {"done": [], "returned": {7: 5}, "want": False}
    finally:
        feed.close()


def test_a_reset_with_no_ask_in_flight_gives_nothing_back() -> None:
    queue = Queue()
    feed = Feed(cast(CoordinatorClient, queue), name="worker-0")
    try:
        feed.reset()
        assert queue.calls == []
    finally:
        feed.close()
