"""Arrays as a dataset: named arrays held in memory (or memory-mapped), sharded by worker and
shuffled per epoch, deterministically; the base every dataset of jaxps builds on."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from jaxps_runtime.config import catalog

Batch = dict[str, np.ndarray]
"""Named arrays with the same number of rows."""

ModelError = catalog.ModelError


class Dataset(Protocol):
    """Deterministic, sharded training batches and a held-out set."""

    def train_batch(self, *, worker: int, num_workers: int, step: int, batch_size: int) -> Batch:
        """Exactly `batch_size` rows of worker `worker`'s shard; a function of (seed, worker,
        num_workers, step)."""
        ...

    def test(self) -> Batch:
        """The whole held-out set."""
        ...


@functools.lru_cache(maxsize=16)
def _epoch_order(seed: int, *, worker: int, epoch: int, size: int) -> np.ndarray:
    """The order worker `worker` reads its `size` rows in during `epoch` (cached, read-only)."""
    order = np.random.default_rng([seed, worker, epoch]).permutation(size)
    order.setflags(write=False)
    return order


def _frozen(arrays: Mapping[str, np.ndarray]) -> Batch:
    for array in arrays.values():
        array.setflags(write=False)
    return dict(arrays)


class ArrayDataset:
    """A dataset held in memory as named arrays; the base of the built-in datasets.

    The training set is in a seed-shuffled order; worker ``w`` of ``n`` owns rows ``w::n`` and
    reads them in a permutation drawn from (seed, worker, epoch), epoch after epoch.
    """

    def __init__(
        self, *, train: Mapping[str, np.ndarray], test: Mapping[str, np.ndarray], seed: int
    ) -> None:
        self._train = _frozen(train)
        self._test = _frozen(test)
        self.seed = seed
        self.num_train = len(next(iter(self._train.values())))

    def train_indices(
        self, *, worker: int, num_workers: int, step: int, batch_size: int
    ) -> np.ndarray:
        """Rows of the training set in the batch :meth:`train_batch` returns (int64)."""
        if num_workers < 1 or not 0 <= worker < num_workers or step < 0 or batch_size < 1:
            raise ValueError(
                f"need 0 <= worker < num_workers, step >= 0 and batch_size >= 1; got "
                f"worker={worker}, num_workers={num_workers}, step={step}, batch_size={batch_size}"
            )
        if num_workers > self.num_train:
            raise ModelError(
                f"dataset: {num_workers} workers but only {self.num_train} training examples; "
                "every worker needs at least one"
            )
        shard = np.arange(worker, self.num_train, num_workers, dtype=np.int64)
        epochs, offsets = np.divmod(step * batch_size + np.arange(batch_size), len(shard))
        rows = np.empty(batch_size, np.int64)
        for epoch in np.unique(epochs):
            pick = epochs == epoch
            order = _epoch_order(self.seed, worker=worker, epoch=int(epoch), size=len(shard))
            rows[pick] = shard[order[offsets[pick]]]
        return rows

    def examples(self, rows: np.ndarray) -> Batch:
        """The training rows `rows` (the shard queue's batches: `data.shards`)."""
        return {key: array[rows] for key, array in self._train.items()}

    def train_batch(self, *, worker: int, num_workers: int, step: int, batch_size: int) -> Batch:
        rows = self.train_indices(
            worker=worker, num_workers=num_workers, step=step, batch_size=batch_size
        )
        return {key: array[rows] for key, array in self._train.items()}

    def test(self) -> Batch:
        return dict(self._test)
