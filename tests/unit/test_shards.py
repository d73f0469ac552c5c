"""The cut of the job's data into epochs, batches and shards (`ShardPlan`): every training row
exactly once per epoch, the last batch holding the rows left, an order per (seed, epoch) that
the chief and every worker compute alike; and a dataset that cannot read rows by index as one
endless stream."""

from __future__ import annotations

import numpy as np
import pytest

from jaxps_runtime.data import shards
from jaxps_runtime.data.arrays import ArrayDataset, Batch
from jaxps_runtime.data.shards import (
    MAX_SHARD_BATCHES,
    MIN_SHARDS_PER_EPOCH,
    STREAM_SHARD_BATCHES,
    ShardPlan,
    examples_of,
)


def _arrays(rows: int, *, seed: int = 0) -> ArrayDataset:
    x = np.arange(rows, dtype=np.float32)[:, None]
    return ArrayDataset(
        train={"x": x, "y": np.arange(rows, dtype=np.int64)},
        test={"x": x[:1], "y": np.zeros(1, np.int64)},
        seed=seed,
    )


class _Stream:
    """A dataset of unknown size: `train_batch` only, each batch saying which it was."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int]] = []

    def train_batch(self, *, worker: int, num_workers: int, step: int, batch_size: int) -> Batch:
        self.calls.append((worker, num_workers, step, batch_size))
        return {"x": np.full((batch_size, 1), step, np.float32)}

    def test(self) -> Batch:
        return {"x": np.zeros((1, 1), np.float32)}


def _epoch_rows(plan: ShardPlan, epoch: int) -> list[np.ndarray]:
    assert plan.batches is not None
    return [plan.rows(epoch, b) for b in range(plan.batches)]


@pytest.mark.parametrize(("examples", "batch_size"), [(10, 3), (12, 4), (1, 32), (97, 8)], ids=str)
def test_every_row_is_in_exactly_one_batch_of_each_epoch(examples: int, batch_size: int) -> None:
    plan = ShardPlan(examples=examples, batch_size=batch_size, shard_batches=2, seed=5)
    for epoch in (0, 1, 7):
        batches = _epoch_rows(plan, epoch)
        assert len(batches) == plan.batches == -(-examples // batch_size)
        assert [len(b) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
        assert len(batches[-1]) == examples - batch_size * (len(batches) - 1)  # the rows left
        rows = np.concatenate(batches)
        assert rows.dtype == np.int64
        assert sorted(rows.tolist()) == list(range(examples))


def test_shards_cut_the_epochs_batches_the_last_one_holding_those_left() -> None:
    plan = ShardPlan(examples=10, batch_size=2, shard_batches=2, seed=0)  # 5 batches
    assert plan.shards == 3
    assert [plan.span(s) for s in range(3)] == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.parametrize(
    ("batches", "per_shard", "tail"), [(45, 5, 5), (10, 3, 3), (4, 3, 3), (7, 1, 0)]
)
def test_an_epochs_last_batches_are_shards_of_one_and_every_batch_is_in_one_shard(
    batches: int, per_shard: int, tail: int
) -> None:
    plan = ShardPlan(
        examples=batches * 4 - 1, batch_size=4, shard_batches=per_shard, seed=0, tail=tail
    )
    assert plan.shards is not None
    spans = [plan.span(s) for s in range(plan.shards)]
    assert [b for first, end in spans for b in range(first, end)] == list(range(batches))
    assert all(end - first == 1 for first, end in spans[len(spans) - tail :])
    assert all(1 <= end - first <= per_shard for first, end in spans)


def test_a_plan_of_a_dataset_ends_each_epoch_with_shards_of_one_batch() -> None:
    plan = ShardPlan.of(_arrays(1437), batch_size=32, seed=0)  # digits: 45 batches
    assert (plan.batches, plan.shard_batches, plan.tail) == (45, 5, 5)
    assert (plan.span(7), plan.span(8)) == ((35, 40), (40, 41))  # 8 shards of 5, 5 of 1
    assert plan.shards == 13
    assert plan.span(12) == (44, 45)
    assert "the last 5 of one batch" in str(plan)


def test_orders_differ_by_epoch_and_seed_and_are_the_same_everywhere() -> None:
    plan = ShardPlan(examples=200, batch_size=200, shard_batches=1, seed=1)
    first = plan.rows(0, 0)
    assert not np.array_equal(first, plan.rows(1, 0))
    assert not np.array_equal(first, ShardPlan(200, 200, 1, seed=2).rows(0, 0))
    shards._epoch_order.cache_clear()  # as in another process: drawn anew, not remembered
    again = ShardPlan(examples=200, batch_size=200, shard_batches=1, seed=1)
    assert np.array_equal(first, again.rows(0, 0))
    assert np.array_equal(plan.rows(1, 0), again.rows(1, 0))
    assert not first.flags.writeable  # the cached order cannot be changed by a reader


def test_a_plan_of_a_dataset_cuts_each_epoch_into_many_shards_of_at_most_32_batches() -> None:
    data = _arrays(1000)
    plan = ShardPlan.of(data, batch_size=10, seed=3)
    assert (plan.examples, plan.batch_size, plan.seed) == (1000, 10, 3)
    assert plan.batches == 100
    assert plan.shard_batches == 100 // MIN_SHARDS_PER_EPOCH  # at least that many shards
    assert plan.tail == plan.shard_batches  # then a shard's worth of one-batch shards
    assert plan.shards == -(-(100 - plan.tail) // plan.shard_batches) + plan.tail
    assert plan.shards >= MIN_SHARDS_PER_EPOCH
    assert ShardPlan.of(_arrays(100_000), batch_size=10, seed=0).shard_batches == MAX_SHARD_BATCHES
    tiny = ShardPlan.of(_arrays(3), batch_size=10, seed=0)
    assert (tiny.batches, tiny.shard_batches, tiny.shards) == (1, 1, 1)


def test_a_batch_is_read_by_its_rows_from_any_worker() -> None:
    data = _arrays(50)
    plan = ShardPlan.of(data, batch_size=8, seed=4)
    batch = plan.read(data, epoch=2, batch=6)  # the epoch's last batch: 2 rows
    rows = plan.rows(2, 6)
    assert len(rows) == 2
    assert np.array_equal(batch["y"], rows)
    assert np.array_equal(batch["x"][:, 0], rows.astype(np.float32))  # rows stay paired


def test_a_dataset_without_rows_by_index_is_a_stream_read_as_one_worker() -> None:
    stream = _Stream()
    assert examples_of(stream) is None
    plan = ShardPlan.of(stream, batch_size=4, seed=0)
    assert plan.examples is None
    assert plan.batches is None
    assert plan.shards is None
    assert plan.shard_batches == STREAM_SHARD_BATCHES
    assert plan.span(2) == (2 * STREAM_SHARD_BATCHES, 3 * STREAM_SHARD_BATCHES)  # no end
    batch = plan.read(stream, epoch=3, batch=37)
    assert stream.calls == [(0, 1, 37, 4)]  # train_batch(worker=0, num_workers=1, step=b)
    assert np.array_equal(batch["x"], np.full((4, 1), 37, np.float32))
    with pytest.raises(ValueError, match="a stream dataset has no rows by index"):
        plan.rows(0, 0)


def test_a_dataset_with_no_training_rows_known_is_a_stream() -> None:
    class Sized(_Stream):
        num_train = 0

        def examples(self, rows: np.ndarray) -> Batch:
            return {"x": rows[:, None].astype(np.float32)}

    assert examples_of(Sized()) is None
    Sized.num_train = 9
    assert examples_of(Sized()) == 9
