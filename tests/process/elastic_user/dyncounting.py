"""The counting model (`counting`) on a dynamic embedding table: record ``i`` is the 64-bit id
``KEYS[i]`` (a hash, negative ones included), and its count is the one value of that id's row.

    model: {name: dyncounting, module: "dyncounting:make_model"}
    dataset: {module: "dyncounting:make_dataset", kwargs: {records: 640, batchSeconds: 0.05}}
    optimizer: {name: sign_sgd, kwargs: {learning_rate: 1}}
    embeddings: {count: {dim: 1, maxRows: 1280, initializer: {scale: 0}}}

The loss of a batch is ``-sum(count[key])`` (read sparsely: ``sparse = {"count": "key"}``), so
an applied update adds exactly +1 to the row of each of its records, as in `counting`; rows
start at 0 (initializer scale 0) and, admitted on first sight (minCount 1) within a bound that
holds every record, a row's value is how many times its record was applied. The model's own
table is declared 2 rows: a dynamic table's rows are the ps's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def keys(records: int) -> np.ndarray:
    """Record i's id: a splitmix64 of i, as int64 (about half of them negative)."""
    with np.errstate(over="ignore"):
        z = np.arange(records, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))).view(np.int64)


class DynamicCountingModel:
    def __init__(self) -> None:
        self.sparse: Mapping[str, str] = {"count": "key"}

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        del key
        return {"count": jnp.zeros((2, 1), jnp.float32)}

    def loss(self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        return -jnp.sum(params["count"][batch["key"]])

    def evaluate(
        self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        return {"loss": self.loss(params, batch)}


class DynamicCountingDataset:
    """`counting`'s records, each as ``{"key": keys(records)[i]}``; reading a batch takes
    ``batch_seconds``."""

    def __init__(self, *, records: int, batch_seconds: float) -> None:
        self.num_train = records
        self.batch_seconds = batch_seconds
        self._keys = keys(records)

    def examples(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The training rows `rows` (the shard queue's batches)."""
        if self.batch_seconds:
            time.sleep(self.batch_seconds)
        return {"key": self._keys[rows]}

    def train_batch(
        self, *, worker: int, num_workers: int, step: int, batch_size: int
    ) -> dict[str, np.ndarray]:
        """The dataset protocol's batch; the runtime reads `examples` instead."""
        rows = (np.arange(batch_size) + (step * num_workers + worker) * batch_size) % self.num_train
        return self.examples(rows)

    def test(self) -> dict[str, np.ndarray]:
        return {"key": self._keys[:32].copy()}


def make_model(**kwargs: Any) -> DynamicCountingModel:
    if kwargs:
        raise TypeError(f"unknown arguments {sorted(kwargs)}")
    return DynamicCountingModel()


def make_dataset(**kwargs: Any) -> DynamicCountingDataset:
    """``records`` (default 640), ``batchSeconds`` (0)."""
    dataset = DynamicCountingDataset(
        records=int(kwargs.pop("records", 640)),
        batch_seconds=float(kwargs.pop("batchSeconds", 0.0)),
    )
    if kwargs:
        raise TypeError(f"unknown arguments {sorted(kwargs)}")
    return dataset
