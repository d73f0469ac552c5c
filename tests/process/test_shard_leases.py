"""The chief's shard queue over real gRPC on 127.0.0.1 (`CoordinatorServicer`, a worker's
`Feed` and `CoordinatorClient`): a lease the worker lost never holds a data epoch's end. One
it trains when it learns of a rollback late goes back when its feed resets; one whose reply it
never got is taken back at its next ask, which says what it holds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.train.coordinator import CoordinatorClient, CoordinatorServicer, Membership
from jaxps_runtime.train.feed import Feed
from jaxps_runtime.train.shardqueue import ShardQueue
from jaxps_runtime.wire import rpc

pytestmark = pytest.mark.process
JOB_ID = "test-job"
PLAN = ShardPlan(examples=12, batch_size=2, shard_batches=2, seed=0)  # 3 shards of 2 batches


class Chief:
    """A chief's Coordinator service alone, with its queue, for worker-0 and worker-1."""

    def __init__(self) -> None:
        self.membership = Membership(
            job_id=JOB_ID, workers=["worker-0", "worker-1"], now=time.monotonic()
        )
        self.queue = ShardQueue(PLAN)
        self.queue.restore({})
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        servicer = CoordinatorServicer(self.membership, task="worker-0", queue=self.queue)
        self.server.add_generic_rpc_handlers((rpc.COORDINATOR.generic_handler(servicer),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def client(self, task: str) -> CoordinatorClient:
        client = CoordinatorClient(
            address=f"127.0.0.1:{self.port}", job_id=JOB_ID, task=task, incarnation=7
        )
        assert client.register(timeout=10) is not None
        return client


@pytest.fixture
def chief() -> Iterator[Chief]:
    running = Chief()
    yield running
    running.server.stop(grace=None)


def _train_until_epoch(feed: Feed, queue: ShardQueue, epoch: int, seconds: float = 20) -> None:
    """Trains the feed's batches (each applied at once) until the queue is at `epoch`."""
    deadline = time.monotonic() + seconds
    while queue.counts().epoch < epoch:
        assert time.monotonic() < deadline, f"stuck: {queue.counts()}, waiting: {feed.waiting}"
        if feed.batch() is None:
            feed.wait(0.05)
        else:
            feed.settle([], step=0)


def test_a_lease_the_worker_trains_when_it_learns_of_a_rollback_goes_back(chief: Chief) -> None:
    client = chief.client("worker-0")
    feed = Feed(client, name="worker-0")
    try:
        assert feed.batch() is not None  # a lease of the queue before the rollback
        chief.queue.hold()
        chief.queue.restore({})  # the chief rolled the ps tier back
        assert feed.settle([], step=0)
        at = feed.batch()  # that shard's last batch: it asks ahead, of the restored queue
        assert at is not None
        feed.settle([], step=0)
        assert feed.batch() is not None  # a lease of the restored queue it trains
        feed.reset()  # ... when it learns of the rollback
        _train_until_epoch(feed, chief.queue, 1)
        assert chief.queue.counts().reclaimed == 0  # given back, not taken back
    finally:
        feed.close()
        client.close()


def test_a_lease_whose_reply_the_worker_never_got_is_taken_back_at_its_next_ask(
    chief: Chief,
) -> None:
    client = chief.client("worker-1")
    lost = client.lease(want=True)  # a reply the worker never got (it timed out, say)
    assert lost.HasField("lease")
    feed = Feed(client, name="worker-1")
    try:
        _train_until_epoch(feed, chief.queue, 1)
        assert chief.queue.counts().reclaimed == 1
    finally:
        feed.close()
        client.close()


def test_an_ask_held_when_its_worker_leaves_brings_it_no_shard(chief: Chief) -> None:
    # worker-1 waits at the data epoch's end (its ask held by the chief) when it drains on
    # SIGTERM and leaves; worker-0 then finishes the epoch's last shards
    staying, leaving = chief.client("worker-0"), chief.client("worker-1")
    try:
        leases: list[int] = []
        for _ in range(3):  # each ask says which it holds
            leases.append(staying.lease(want=True, held=leases).lease.lease)
        with futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(leaving.lease, want=True, wait_ms=1000)
            deadline = time.monotonic() + 10
            while not chief.queue._waiters:  # the ask is with the chief
                assert time.monotonic() < deadline, "the ask was not held"
                time.sleep(0.01)
            leaving.lease(want=False, leaving=True)
            staying.lease(done=leases, want=False)  # the epoch ends
            reply = held.result(timeout=10)
        assert not reply.HasField("lease"), reply
        assert reply.over
        assert chief.queue.holders() == set()
        assert staying.lease(want=True).lease.epoch == 1
    finally:
        staying.close()
        leaving.close()
