"""The job's data as one stream of shards: what the chief's shard queue leases and a worker
reads. Pure and deterministic, so the chief and every worker agree on it without a word.

Each data epoch draws an order of the training rows from (seed, epoch), cuts it into batches of
`batch_size` rows (the epoch's last batch holds the rows left, fewer when the size does not
divide) and the batches into shards of `shard_batches` batches, except its last `tail` batches,
one shard each: the workers that finish first take those while the others finish their shards,
so an epoch's end (which the next epoch waits for) leaves nobody idle for more than a batch.
Records are never repeated or skipped inside an epoch, and an epoch ends exactly where its rows
do.

A dataset of the `Dataset` protocol that only says `train_batch(worker, num_workers, step,
batch_size)` (the user's own object, of unknown size) is one endless stream instead: its batch
`b` is `train_batch(worker=0, num_workers=1, step=b)`, cut into shards the same way, all in
epoch 0. Either way a batch is a function of (epoch, batch index) alone: any worker can read any
batch, which is what lets workers come and go.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxps_runtime.data.arrays import Batch, Dataset

# How many batches make a shard: a shard is the unit the queue leases and takes back, so small
# enough that an epoch has many (a worker that leaves gives back little; the last shards of an
# epoch, which some workers wait on in sync mode, are short) and large enough that asking for
# one is rare next to the steps it feeds.
MAX_SHARD_BATCHES = 32
MIN_SHARDS_PER_EPOCH = 8
STREAM_SHARD_BATCHES = 16


@dataclass(frozen=True)
class ShardPlan:
    """The cut of the data: rows per epoch (None: an endless stream), rows per batch, batches per
    shard."""

    examples: int | None
    batch_size: int
    shard_batches: int
    seed: int
    tail: int = 0  # the epoch's last batches, one shard each (not for a stream)

    @classmethod
    def of(cls, dataset: Dataset, *, batch_size: int, seed: int) -> ShardPlan:
        examples = examples_of(dataset)
        if examples is None:
            return cls(None, batch_size, STREAM_SHARD_BATCHES, seed)
        batches = math.ceil(examples / batch_size)
        per_shard = max(1, min(MAX_SHARD_BATCHES, batches // MIN_SHARDS_PER_EPOCH))
        tail = min(per_shard, batches - 1) if per_shard > 1 else 0
        return cls(examples, batch_size, per_shard, seed, tail)

    @property
    def batches(self) -> int | None:
        """Batches per epoch (None for a stream)."""
        return None if self.examples is None else math.ceil(self.examples / self.batch_size)

    @property
    def shards(self) -> int | None:
        """Shards per epoch (None for a stream)."""
        batches = self.batches
        if batches is None:
            return None
        return self._head_shards(batches) + self.tail

    def __str__(self) -> str:
        cut = f"shards of {self.shard_batches} batches of {self.batch_size}"
        if self.examples is None:
            return f"a stream: {cut}"
        tail = f" (the last {self.tail} of one batch)" if self.tail else ""
        return f"{self.examples} examples a data epoch, {self.shards} {cut}{tail}"

    @property
    def short_batch(self) -> int | None:
        """The index of each epoch's last batch when it is shorter than the others (the rows
        do not divide into batches), else None."""
        if self.examples is None or self.examples % self.batch_size == 0:
            return None
        return self.examples // self.batch_size

    def span(self, shard: int) -> tuple[int, int]:
        """The batches [first, end) of `shard` in its epoch."""
        batches = self.batches
        if batches is None:
            first = shard * self.shard_batches
            return first, first + self.shard_batches
        head = self._head_shards(batches)
        if shard >= head:  # one batch of the tail
            first = batches - self.tail + (shard - head)
            return first, first + 1
        first = shard * self.shard_batches
        return first, min(first + self.shard_batches, batches - self.tail)

    def _head_shards(self, batches: int) -> int:
        return math.ceil((batches - self.tail) / self.shard_batches)

    def rows(self, epoch: int, batch: int) -> np.ndarray:
        """The training rows of batch `batch` of `epoch` (int64), in the epoch's order."""
        if self.examples is None:
            raise ValueError("a stream dataset has no rows by index")
        order = _epoch_order(self.seed, epoch=epoch, size=self.examples)
        return order[batch * self.batch_size : (batch + 1) * self.batch_size]

    def read(self, dataset: Dataset, *, epoch: int, batch: int) -> Batch:
        """Batch `batch` of `epoch`, from `dataset`."""
        if self.examples is None:
            return dataset.train_batch(
                worker=0, num_workers=1, step=batch, batch_size=self.batch_size
            )
        examples: Any = getattr(dataset, "examples")  # noqa: B009 (examples_of checked it)
        batch_rows: Batch = examples(self.rows(epoch, batch))
        return batch_rows


def examples_of(dataset: Dataset) -> int | None:
    """How many training rows `dataset` has, when it can read rows by index (`examples(rows)`
    and `num_train`, as every dataset of jaxps and the user's arrays can); None otherwise."""
    size = getattr(dataset, "num_train", None)
    if callable(getattr(dataset, "examples", None)) and isinstance(size, int) and size > 0:
        return size
    return None


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, *, epoch: int, size: int) -> np.ndarray:
    """The order of the training rows in `epoch` (cached, read-only)."""
    order = np.random.default_rng([seed, 0x5A4D, epoch]).permutation(size).astype(np.int64)
    order.setflags(write=False)
    return order
