"""The chief's shard queue, driven directly: shards leased lowest first, an epoch started only
once every shard of the one before is done, shards given back or taken back going on from where
they stopped (never from their start), the queue rebuilt from the ps tier's positions, streams
without an end, batches that diverged skipped, and nothing leased once training is over."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.train.shardqueue import Answer, Lease, ShardQueue

# 5 batches an epoch in shards of 2: [0, 2), [2, 4), [4, 5)
PLAN = ShardPlan(examples=10, batch_size=2, shard_batches=2, seed=0)
STREAM = ShardPlan(examples=None, batch_size=4, shard_batches=16, seed=0)


def _until(what: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.01)


def _queue(plan: ShardPlan = PLAN, positions: dict[str, int] | None = None) -> ShardQueue:
    queue = ShardQueue(plan, first_lease=100)
    queue.restore(positions or {})
    return queue


def _lease(queue: ShardQueue, worker: str = "worker-0") -> Lease:
    answer = queue.lease(worker)
    assert answer.lease is not None, answer.waiting
    assert not answer.over
    return answer.lease


def _waiting(queue: ShardQueue, worker: str = "worker-0") -> str:
    answer = queue.lease(worker)
    assert answer.lease is None, answer.lease
    return answer.waiting


def test_nothing_is_leased_before_the_chief_brings_the_ps_tier_up() -> None:
    queue = ShardQueue(PLAN, first_lease=1)
    assert _waiting(queue) == "the chief to bring the ps tier up"
    queue.restore({})
    assert _lease(queue).shard == 0


def test_shards_are_leased_in_order_each_with_its_batches_and_a_new_id() -> None:
    queue = _queue()
    leases = [_lease(queue, f"worker-{i}") for i in range(3)]
    assert [(x.epoch, x.shard, x.first, x.end, x.start) for x in leases] == [
        (0, 0, 0, 2, 0),
        (0, 1, 2, 4, 0),
        (0, 2, 4, 5, 0),  # the last shard holds the batches left
    ]
    assert [x.lease for x in leases] == [100, 101, 102]
    assert [x.worker for x in leases] == ["worker-0", "worker-1", "worker-2"]
    assert leases[1].key == "0:1"
    assert queue.holders() == {"worker-0", "worker-1", "worker-2"}
    counts = queue.counts()
    assert (counts.epoch, counts.shards, counts.done, counts.leased) == (0, 3, 0, 3)


def test_the_next_epoch_starts_only_once_every_shard_is_done_and_none_is_leased() -> None:
    queue = _queue()
    leases = [_lease(queue) for _ in range(3)]
    assert _waiting(queue) == (
        "data epoch 0 to end: its last 3 shards are still leased (worker-0: shards 0, 1, 2)"
    )
    queue.done("worker-0", [leases[0].lease, leases[1].lease])
    assert queue.counts().done == 2
    waiting = _waiting(queue, "worker-1")
    assert waiting == "data epoch 0 to end: its last 1 shard is still leased (worker-0: shard 2)"
    queue.done("worker-1", [leases[2].lease])  # not worker-1's lease: ignored
    assert queue.counts().done == 2
    queue.done("worker-0", [leases[2].lease, 999])  # an id the queue never gave: ignored
    assert queue.counts().done == 3
    assert queue.holders() == set()
    following = _lease(queue)
    assert (following.epoch, following.shard, following.start) == (1, 0, 0)
    counts = queue.counts()
    assert (counts.epoch, counts.done, counts.leased) == (1, 0, 1)


def test_an_ask_held_at_the_epochs_end_is_answered_as_soon_as_the_epoch_turns() -> None:
    queue = _queue()
    leases = [_lease(queue) for _ in range(3)]
    answers: list[Lease | None] = []
    held = threading.Thread(target=lambda: answers.append(queue.lease("w-1", wait=60).lease))
    started = time.monotonic()
    held.start()
    queue.done("worker-0", [x.lease for x in leases[:2]])  # not the last: still held
    time.sleep(0.05)  # (a chance to answer too early, which the assertion below would see)
    assert held.is_alive()
    queue.done("worker-0", [leases[2].lease])
    held.join(timeout=30)
    assert not held.is_alive(), "the held ask was not answered when the epoch ended"
    assert time.monotonic() - started < 30
    assert answers[0] is not None
    assert (answers[0].epoch, answers[0].shard) == (1, 0)


def test_a_held_ask_ends_with_no_shard_after_its_wait_or_when_training_ends() -> None:
    queue = _queue()
    for _ in range(3):
        _lease(queue)
    started = time.monotonic()
    answer = queue.lease("w-1", wait=0.2)
    assert answer.lease is None
    assert not answer.over
    assert time.monotonic() - started >= 0.2
    over: list[bool] = []
    held = threading.Thread(target=lambda: over.append(queue.lease("w-1", wait=60).over))
    held.start()
    queue.finish()
    held.join(timeout=30)
    assert over == [True]


def test_a_lease_its_worker_no_longer_holds_is_taken_back_at_its_next_ask() -> None:
    """A worker that dropped a lease (a rollback it learnt of after the restored queue leased
    it the shard) says what it holds when it asks: the queue takes the rest back, from where the
    ps tier was last seen to have the shard, and the epoch can end."""
    queue = _queue()
    lost, kept = _lease(queue, "worker-0"), _lease(queue, "worker-0")
    other = _lease(queue, "worker-1")
    queue.observe({lost.key: 1})
    queue.done("worker-1", [other.lease])
    queue.done("worker-0", [kept.lease])
    assert "worker-0: shard 0" in _waiting(queue, "worker-1")  # the end waits for it
    again = queue.lease("worker-0", held=[]).lease
    assert again is not None
    assert (again.shard, again.start) == (lost.shard, 1)  # from the ps tier's position
    assert again.lease > other.lease
    assert queue.counts().reclaimed == 1
    queue.done("worker-0", [again.lease])
    assert _lease(queue, "worker-1").epoch == 1  # the epoch ended


def test_a_lease_its_worker_says_it_holds_stays_its_own() -> None:
    queue = _queue()
    held = _lease(queue, "worker-0")
    second = queue.lease("worker-0", held=[held.lease]).lease
    assert second is not None
    assert queue.holders() == {"worker-0"}
    assert queue.counts().leased == 2
    assert queue.counts().reclaimed == 0
    queue.lease("worker-1", held=[])  # another worker's ask takes nothing of worker-0's
    assert queue.counts().leased == 3


def test_an_ask_that_says_nothing_of_what_it_holds_takes_nothing_back() -> None:
    queue = _queue()
    _lease(queue, "worker-0")
    _lease(queue, "worker-0")
    assert queue.counts().leased == 2


def test_a_worker_that_left_is_leased_nothing_more_not_even_by_an_ask_held_before() -> None:
    """An ask held at an epoch's end when its worker leaves (drained on SIGTERM) would be
    answered with the next epoch's first shard, which nobody would ever train."""
    queue = _queue()
    leases = [_lease(queue, "worker-0") for _ in range(3)]
    answers: list[object] = []
    held = threading.Thread(target=lambda: answers.append(queue.lease("worker-1", wait=10)))
    held.start()
    _until(lambda: queue._waiters == 1)  # the ask is held
    assert queue.leave("worker-1") == []
    queue.done("worker-0", [lease.lease for lease in leases])
    held.join(10)
    [answer] = answers
    assert isinstance(answer, Answer)
    assert (answer.lease, answer.over) == (None, True)
    assert _lease(queue, "worker-0").epoch == 1
    assert queue.holders() == {"worker-0"}
    queue.join("worker-1")  # a new process of it registered
    assert _lease(queue, "worker-1").epoch == 1


def test_a_worker_that_leaves_has_its_leases_taken_back() -> None:
    queue = _queue()
    lease = _lease(queue, "worker-1")
    queue.observe({lease.key: 1})
    assert queue.leave("worker-1") == [lease]
    again = _lease(queue, "worker-0")
    assert (again.shard, again.start) == (lease.shard, 1)


def test_a_shard_given_back_goes_on_from_where_its_holder_got() -> None:
    queue = _queue()
    first = _lease(queue, "worker-1")
    queue.give_back("worker-1", {first.lease: 1})  # worker-1 leaves after batch 0
    again = _lease(queue, "worker-0")
    assert (again.shard, again.start, again.first, again.end) == (0, 1, 0, 2)
    assert again.lease > first.lease
    # Given back again as at its start: it never goes back before where it was leased from
    queue.give_back("worker-0", {again.lease: 0})
    assert _lease(queue, "worker-2").start == 1


def test_a_shard_given_back_whole_is_done() -> None:
    queue = _queue()
    first = _lease(queue)
    queue.give_back("worker-0", {first.lease: 2})
    assert queue.counts().done == 1
    assert _lease(queue).shard == 1


def test_a_lease_given_back_that_is_not_the_workers_own_is_ignored() -> None:
    queue = _queue()
    first = _lease(queue, "worker-0")
    queue.give_back("worker-1", {999: 1})  # an id the queue never gave
    assert queue.holders() == {"worker-0"}
    assert _lease(queue, "worker-1").shard == 1
    queue.done("worker-0", [first.lease])
    assert queue.counts().done == 1


def test_a_lease_given_back_by_another_worker_stays_its_holders() -> None:
    queue = _queue()
    first = _lease(queue, "worker-0")
    queue.give_back("worker-1", {first.lease: 1})
    assert queue.holders() == {"worker-0"}
    queue.done("worker-0", [first.lease])
    assert queue.counts().done == 1


def test_reclaim_takes_back_every_lease_of_a_worker_from_the_positions_the_ps_tier_holds() -> None:
    queue = _queue()
    mine = [_lease(queue, "worker-0"), _lease(queue, "worker-0")]
    theirs = _lease(queue, "worker-1")
    queue.observe({"0:0": 1, "0:2": 1})  # lowest over the ps: batch 0 of shard 0 is in
    taken = queue.reclaim("worker-0")
    assert sorted(x.lease for x in taken) == [mine[0].lease, mine[1].lease]
    assert queue.holders() == {"worker-1"}
    assert queue.counts().reclaimed == 2
    shard0, shard1 = _lease(queue, "worker-2"), _lease(queue, "worker-2")
    assert (shard0.shard, shard0.start) == (0, 1)
    assert (shard1.shard, shard1.start) == (1, 0)
    assert theirs.shard == 2  # not reclaimed: its worker still holds it
    assert queue.reclaim("worker-9") == []


def test_reclaim_never_goes_back_before_where_the_shard_was_leased_from() -> None:
    queue = _queue()
    first = _lease(queue, "worker-0")
    queue.give_back("worker-0", {first.lease: 1})
    again = _lease(queue, "worker-1")
    queue.observe({})  # a ps that has not heard of the shard (yet)
    queue.reclaim("worker-1")
    assert _lease(queue, "worker-2").start == again.start == 1


def test_a_shard_reclaimed_whole_is_done() -> None:
    queue = _queue()
    first = _lease(queue, "worker-0")
    queue.observe({first.key: 2})  # applied on every ps before its worker could say so
    queue.reclaim("worker-0")
    assert queue.counts().done == 1
    assert _lease(queue).shard == 1


def test_a_reclaim_after_a_rollback_goes_on_from_the_restored_positions() -> None:
    queue = _queue()
    _lease(queue, "worker-0")
    queue.observe({"0:0": 1})  # before the ps tier was rolled back
    queue.restore({})  # back to a checkpoint taken before batch 0 of shard 0 was in
    _lease(queue, "worker-1")
    queue.reclaim("worker-1")
    assert _lease(queue, "worker-2").start == 0


def test_restore_rebuilds_the_newest_epoch_with_its_partial_shards() -> None:
    queue = _queue()
    old = _lease(queue)
    queue.restore({"2:0": 2, "2:1": 1, "1:0": 2, "1:2": 1, "worker-0": 7})
    counts = queue.counts()
    assert (counts.epoch, counts.done, counts.leased) == (2, 1, 0)
    leases = [_lease(queue), _lease(queue)]
    assert [(x.epoch, x.shard, x.start) for x in leases] == [(2, 1, 1), (2, 2, 0)]
    # Every lease before the restore is void: its reports change nothing
    queue.done("worker-0", [old.lease])
    queue.give_back("worker-0", {old.lease: 2})
    assert queue.counts().done == 1
    assert old.lease < leases[0].lease


def test_restore_of_an_epoch_every_shard_of_which_is_done_starts_the_next() -> None:
    queue = _queue(positions={"3:0": 2, "3:1": 2, "3:2": 1})
    first = _lease(queue)
    assert (first.epoch, first.shard, first.start) == (4, 0, 0)


def test_restore_with_no_positions_starts_at_epoch_0() -> None:
    queue = _queue(positions={"5:1": 1})
    queue.restore({})
    assert queue.counts().epoch == 0
    assert _lease(queue).key == "0:0"


def test_lease_ids_keep_growing_across_a_new_queue() -> None:
    earlier = ShardQueue(PLAN)
    earlier.restore({})
    last = max(_lease(earlier).lease for _ in range(3))
    later = ShardQueue(PLAN)  # a new chief
    later.restore({"0:0": 1})
    assert _lease(later).lease > last


def test_a_stream_is_leased_shard_after_shard_and_never_ends() -> None:
    queue = _queue(STREAM)
    leases = [_lease(queue) for _ in range(3)]
    assert [(x.epoch, x.shard, x.first, x.end) for x in leases] == [
        (0, 0, 0, 16),
        (0, 1, 16, 32),
        (0, 2, 32, 48),
    ]
    queue.done("worker-0", [x.lease for x in leases])
    assert _lease(queue).shard == 3  # no epoch ends
    counts = queue.counts()
    assert (counts.epoch, counts.shards, counts.done) == (0, 0, 3)


def test_a_stream_given_back_goes_on_before_any_fresh_shard() -> None:
    queue = _queue(STREAM)
    first, second = _lease(queue, "worker-0"), _lease(queue, "worker-1")
    queue.give_back("worker-0", {first.lease: 5})
    again = _lease(queue, "worker-2")
    assert (again.shard, again.start) == (0, 5)
    assert _lease(queue).shard == second.shard + 1


def test_a_restored_stream_goes_on_with_every_shard_below_the_highest_not_done() -> None:
    # Shard 0 done, shard 1 leased but never pushed (no position anywhere), shard 2 partial,
    # shard 3 leased and never pushed too: above the highest, it is leased again as fresh.
    queue = _queue(STREAM, positions={"0:0": 16, "0:2": 5})
    leases = [_lease(queue) for _ in range(3)]
    assert [(x.shard, x.start) for x in leases] == [(1, 0), (2, 5), (3, 0)]
    assert queue.counts().done == 1


def test_a_lease_names_the_batches_of_its_shard_that_diverged() -> None:
    queue = _queue()
    for epoch, batch in ((0, 3), (0, 4), (1, 0)):
        queue.skip(epoch, batch)
    assert [_lease(queue).skip for _ in range(3)] == [(), (3,), (4,)]  # not epoch 1's batch 0


def test_a_stream_lease_names_the_batches_that_diverged_too() -> None:
    queue = _queue(STREAM)
    queue.skip(0, 17)
    queue.skip(0, 3)
    assert [_lease(queue).skip for _ in range(3)] == [(3,), (17,), ()]


def test_a_skip_outlives_a_restore_of_the_same_epoch() -> None:
    queue = _queue()
    queue.skip(0, 4)
    queue.restore({"0:0": 1})
    leases = [_lease(queue) for _ in range(3)]
    assert [x.skip for x in leases] == [(), (), (4,)]


def test_once_finished_nothing_more_is_leased() -> None:
    queue = _queue()
    held = _lease(queue)
    queue.finish()
    answer = queue.lease("worker-1")
    assert answer.over
    assert answer.lease is None
    assert answer.waiting == "training is over"
    queue.done("worker-0", [held.lease])  # reports are still taken
    assert queue.counts().done == 1
    assert queue.lease("worker-0").over
