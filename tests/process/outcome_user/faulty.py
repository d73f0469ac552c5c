"""A user model and dataset that fail on demand, for the process tests of a job's outcome.

With this directory on ``PYTHONPATH`` a TrainingJob names them as any user's own code::

    model: {name: faulty, module: "faulty:make_model", kwargs: {evaluateRaises: true}}
    dataset: {module: "faulty:make_dataset", kwargs: {worker: 1, raiseAt: 3}}

The model is least-squares regression (``y ~ x @ w + b``), the data a fixed linear target plus
noise, so an undisturbed job converges in a few dozen steps. What goes wrong, and where, is
chosen by keyword arguments; each is off by default:

- ``make_model(evaluateRaises=True)``: ``evaluate`` raises ``ArithmeticError`` (at trace time,
  as the runtime jits it: the chief's final evaluation fails, training itself does not);
- ``make_dataset(worker=W, raiseAt=N)``: worker W's ``train_batch`` of batch N raises
  ``LookupError``;
- ``make_dataset(worker=W, nanAt=N)``: worker W's batch N has a NaN input (only that batch:
  a worker that skips it, as a rollback on divergence does, trains on finite data);
- ``make_dataset(batchSeconds=S)``: every ``train_batch`` sleeps S seconds first (on every
  worker): training goes at a pace a test can act within;
- ``make_dataset(worker=W, slowAt=N, slowSeconds=S)``: worker W's batch N takes S seconds more;
- ``make_dataset(worker=W, blockAt=N)``: worker W's ``train_batch`` of batch N never returns
  (the task's own stop cannot end it either: the runtime's forced exit does).

A batch is a function of (worker, batch) only, as the dataset contract requires of an object
with ``train_batch``: a restarted worker reads the same data. The raising lines are this file's,
so a `UserCodeError` names them (``RAISES_LINE``, ``EVALUATE_RAISES_LINE``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_TEST_EXAMPLES = 256


class FaultyModel:
    """``y ~ x @ w + b`` on the mean squared error; parameters start at zero."""

    def __init__(self, *, features: int, evaluate_raises: bool) -> None:
        self.features = features
        self.evaluate_raises = evaluate_raises
        self.sparse: Mapping[str, str] = {}

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        del key
        return {"w": jnp.zeros((self.features,), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}

    def loss(self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        prediction = batch["x"] @ params["w"] + params["b"][0]
        return jnp.mean((prediction - batch["y"]) ** 2)

    def evaluate(
        self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        if self.evaluate_raises:
            raise ArithmeticError("faulty evaluate: the metric cannot be computed")  # EVALUATE
        return {"loss": self.loss(params, batch)}


class FaultyDataset:
    """Worker ``worker``'s batch ``raise_at`` raises, ``nan_at`` holds a NaN, ``block_at``
    never comes; every other batch is clean."""

    def __init__(
        self,
        *,
        features: int,
        worker: int,
        raise_at: int | None,
        nan_at: int | None,
        block_at: int | None,
        batch_seconds: float,
        slow_at: int | None,
        slow_seconds: float,
    ) -> None:
        self.features = features
        self.batch_seconds = batch_seconds
        self.slow_at, self.slow_seconds = slow_at, slow_seconds
        self.worker = worker
        self.raise_at, self.nan_at, self.block_at = raise_at, nan_at, block_at
        self.target = np.linspace(-1.0, 1.0, features, dtype=np.float32)

    def _rows(self, seed: int, count: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(count, self.features)).astype(np.float32)
        y = (x @ self.target + 0.5 + 0.01 * rng.normal(size=count)).astype(np.float32)
        return {"x": x, "y": y}

    def train_batch(
        self, *, worker: int, num_workers: int, step: int, batch_size: int
    ) -> dict[str, np.ndarray]:
        del num_workers  # each worker's batches are its own, however many there are
        if self.batch_seconds:
            time.sleep(self.batch_seconds)
        if worker == self.worker and step == self.slow_at:
            time.sleep(self.slow_seconds)
        if worker == self.worker and step == self.raise_at:
            raise LookupError(f"faulty dataset: no batch {step} for worker {worker}")  # RAISES
        if worker == self.worker and step == self.block_at:
            threading.Event().wait()  # never set: this batch never comes
        batch = self._rows(1_000_003 * (worker + 1) + step, batch_size)
        if worker == self.worker and step == self.nan_at:
            batch["x"][0, 0] = np.nan
        return batch

    def test(self) -> dict[str, np.ndarray]:
        return self._rows(7, _TEST_EXAMPLES)


def _line(marker: str) -> int:
    """The line of this file that ends with `# <marker>`: what a UserCodeError must name."""
    with open(__file__, encoding="utf-8") as source:
        return next(i for i, line in enumerate(source, 1) if line.rstrip().endswith(f"# {marker}"))


RAISES_LINE = _line("RAISES")
EVALUATE_RAISES_LINE = _line("EVALUATE")


def _optional_count(kwargs: dict[str, Any], key: str) -> int | None:
    value = kwargs.pop(key, None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{key}: expected an integer >= 0, got {value!r}")
    return value


def make_model(**kwargs: Any) -> FaultyModel:
    """``features`` (default 8), ``evaluateRaises`` (false)."""
    model = FaultyModel(
        features=int(kwargs.pop("features", 8)),
        evaluate_raises=bool(kwargs.pop("evaluateRaises", False)),
    )
    if kwargs:
        raise TypeError(f"unknown arguments {sorted(kwargs)}")
    return model


def make_dataset(**kwargs: Any) -> FaultyDataset:
    """``features`` (default 8), ``worker`` (0: the worker that misbehaves), the batch of that
    worker's shard that ``raiseAt``, ``nanAt``, ``blockAt`` or ``slowAt`` (each off by default),
    ``slowSeconds`` (0) and ``batchSeconds`` (0)."""
    dataset = FaultyDataset(
        features=int(kwargs.pop("features", 8)),
        worker=int(kwargs.pop("worker", 0)),
        raise_at=_optional_count(kwargs, "raiseAt"),
        nan_at=_optional_count(kwargs, "nanAt"),
        block_at=_optional_count(kwargs, "blockAt"),
        batch_seconds=float(kwargs.pop("batchSeconds", 0.0)),
        slow_at=_optional_count(kwargs, "slowAt"),
        slow_seconds=float(kwargs.pop("slowSeconds", 0.0)),
    )
    if kwargs:
        raise TypeError(f"unknown arguments {sorted(kwargs)}")
    return dataset
