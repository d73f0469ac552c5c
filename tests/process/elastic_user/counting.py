"""A counting model: its parameters count how often each training record was applied.

With this directory on ``PYTHONPATH`` a TrainingJob names them as any user's own code::

    model: {name: counting, module: "counting:make_model", kwargs: {records: 640}}
    dataset: {module: "counting:make_dataset", kwargs: {records: 640, batchSeconds: 0.05}}
    optimizer: {name: sign_sgd, kwargs: {learning_rate: 1}}

The parameters are one vector, ``count``, a slot per record, zero at the start. Record ``i``
is ``{"id": i}``; the loss of a batch is ``-sum(count[ids])``, whose gradient is -1 on the
slot of each record in the batch and 0 on every other slot. With ``sign_sgd`` at learning rate
1 an applied update adds ``-1 * sign(gradient)``: exactly +1 on the slot of each record it
carries and nothing elsewhere, whatever the mode (sync averages the gradients of the workers'
batches of a step first: ``-1/W`` on each of their records, still of sign -1, since the
records of one data epoch never repeat and epochs never overlap). So the final ``count[i]`` is
how many times record ``i``'s gradient is in the parameters: the exactly-once probe of
research/elastic.md §7, read from the parameters themselves, rollbacks included.

The dataset is the arrays the runtime cuts into shards (``num_train`` and ``examples(rows)``,
what `data.shards.examples_of` asks for), with ``batchSeconds`` of sleep per batch read so that
training goes at a pace a test can scale and kill within. ``train_batch`` and ``test`` make it
an object of the dataset protocol, so the runtime keeps it as it is (and its pacing).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_TEST_RECORDS = 32


class CountingModel:
    """``count[i]``: how many times record ``i`` was applied."""

    def __init__(self, *, records: int) -> None:
        self.records = records
        self.sparse: Mapping[str, str] = {}

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        del key
        return {"count": jnp.zeros((self.records,), jnp.float32)}

    def loss(self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        return -jnp.sum(params["count"][batch["id"]])

    def evaluate(
        self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        return {"loss": self.loss(params, batch)}


class CountingDataset:
    """Records ``{"id": i}`` for ``i < records``; reading a batch takes ``batch_seconds``."""

    def __init__(self, *, records: int, batch_seconds: float) -> None:
        self.num_train = records
        self.batch_seconds = batch_seconds
        self._ids = np.arange(records, dtype=np.int32)

    def examples(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The training rows `rows` (the shard queue's batches)."""
        if self.batch_seconds:
            time.sleep(self.batch_seconds)
        return {"id": self._ids[rows]}

    def train_batch(
        self, *, worker: int, num_workers: int, step: int, batch_size: int
    ) -> dict[str, np.ndarray]:
        """The dataset protocol's batch; the runtime reads `examples` instead."""
        rows = (np.arange(batch_size) + (step * num_workers + worker) * batch_size) % self.num_train
        return self.examples(rows)

    def test(self) -> dict[str, np.ndarray]:
        return {"id": self._ids[:_TEST_RECORDS].copy()}


def make_model(**kwargs: Any) -> CountingModel:
    """``records`` (default 640)."""
    model = CountingModel(records=int(kwargs.pop("records", 640)))
    if kwargs:
        raise TypeError(f"unknown arguments {sorted(kwargs)}")
    return model


def make_dataset(**kwargs: Any) -> CountingDataset:
    """``records`` (default 640), ``batchSeconds`` (0)."""
    dataset = CountingDataset(
        records=int(kwargs.pop("records", 640)),
        batch_seconds=float(kwargs.pop("batchSeconds", 0.0)),
    )
    if kwargs:
        raise TypeError(f"unknown arguments {sorted(kwargs)}")
    return dataset
