"""A user model and dataset that fail on demand, for the process tests of a job's outcome.

With this directory on ``PYTHONPATH`` a TrainingJob names them as any user's own code::

    model: {name: faulty, module: "faulty:make_model", kwargs: {evaluateRaises: true}}
    dataset: {module: "faulty:make_dataset", kwargs: {worker: 1, raiseAt: 3}}

The model is least-squares regression (``y ~ x @ w + b``), the data a fixed linear target plus
noise, so an undisturbed job converges in a few dozen steps. What goes wrong, and where, is
chosen by keyword arguments; each is off by default:

- ``make_model(evaluateRaises=True)``: ``evaluate`` raises ``ArithmeticError`` (at trace time,
  as the runtime jits it: the chief's final evaluation fails, training itself does not);
- ``make_dataset(worker=W, raiseAt=N)``: worker W's read N raises ``LookupError``;
- ``make_dataset(worker=W, nanAt=N)``: the batch of worker W's read N has a NaN input (only that
  read: the batches read after it, a rollback's included, are finite);
- ``make_dataset(batchSeconds=S)``: every read sleeps S seconds first (on every worker):
  training goes at a pace a test can act within;
- ``make_dataset(worker=W, slowAt=N, slowSeconds=S)``: worker W's read N takes S seconds more;
- ``make_dataset(worker=W, blockAt=N)``: worker W's read N never returns (the task's own stop
  cannot end it either: the runtime's forced exit does).

The dataset is the arrays the runtime cuts into shards (``num_train`` rows and
``examples(rows)``, what `data.shards.examples_of` asks for): the chief's shard queue decides
which worker reads which batch, so a fault is tied to the task that reads, not to a batch. A
task knows which it is from ``TF_CONFIG``, as any TensorFlow user's code does. "Read N" is the
N-th batch a task reads to train, counted from 0 in its process (a restarted task counts
afresh); before them each task reads one batch at start-up, to check that the model takes the
dataset's batches (`roles._batch_problems`), which is never faulty. In sync mode each worker
reads once a step, so worker W's read N is its batch of global step N; its read N of a job of
N steps is the one it makes before it sees that the last step is reached. ``train_batch`` and
``test`` make it an object of the dataset protocol, so the runtime keeps it as it is. The
raising lines are this file's, so a `UserCodeError` names them (``RAISES_LINE``,
``EVALUATE_RAISES_LINE``).
"""

from __future__ import annotations

import json
import os
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

    def __init__(
        self,
        *,
        features: int,
        evaluate_raises: bool,
        init_raises: bool = False,
        vector_loss: bool = False,
    ) -> None:
        self.features = features
        self.evaluate_raises = evaluate_raises
        self.init_raises, self.vector_loss = init_raises, vector_loss
        self.sparse: Mapping[str, str] = {}

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        del key
        if self.init_raises:
            raise RuntimeError("faulty init: no parameters to give")  # INIT
        return {"w": jnp.zeros((self.features,), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}

    def loss(self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        prediction = batch["x"] @ params["w"] + params["b"][0]
        errors = (prediction - batch["y"]) ** 2
        return errors if self.vector_loss else jnp.mean(errors)

    def evaluate(
        self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        if self.evaluate_raises:
            raise ArithmeticError("faulty evaluate: the metric cannot be computed")  # EVALUATE
        return {"loss": self.loss(params, batch)}


class FaultyDataset:
    """``records`` rows of a linear target; the read ``raise_at`` of worker ``worker`` raises,
    ``nan_at`` holds a NaN, ``block_at`` never comes, ``slow_at`` takes ``slow_seconds`` more;
    every other read is clean. Reads come from one thread of a task (its training loop)."""

    def __init__(
        self,
        *,
        features: int,
        records: int,
        worker: int,
        raise_at: int | None,
        nan_at: int | None,
        block_at: int | None,
        batch_seconds: float,
        slow_at: int | None,
        slow_seconds: float,
    ) -> None:
        self.features = features
        self.num_train = records
        self.batch_seconds = batch_seconds
        self.slow_at, self.slow_seconds = slow_at, slow_seconds
        self.raise_at, self.nan_at, self.block_at = raise_at, nan_at, block_at
        self.target = np.linspace(-1.0, 1.0, features, dtype=np.float32)
        self._train = self._rows(1_000_003, records)
        self._faulty = _this_task() == ("worker", worker)  # this task is the one that misbehaves
        self.who = f"worker {worker}"
        self._reads = -1  # training reads so far in this process, after the start-up check

    def _rows(self, seed: int, count: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(count, self.features)).astype(np.float32)
        y = (x @ self.target + 0.5 + 0.01 * rng.normal(size=count)).astype(np.float32)
        return {"x": x, "y": y}

    def examples(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The training rows `rows`: the shard queue's batch this task reads now."""
        read, self._reads = self._reads, self._reads + 1  # -1: the start-up check's
        if self.batch_seconds:
            time.sleep(self.batch_seconds)
        if self._faulty and read == self.slow_at:
            time.sleep(self.slow_seconds)
        if self._faulty and read == self.raise_at:
            raise LookupError(f"faulty dataset: no batch at read {read} of {self.who}")  # RAISES
        if self._faulty and read == self.block_at:
            threading.Event().wait()  # never set: this batch never comes
        batch = {name: values[rows] for name, values in self._train.items()}  # copies
        if self._faulty and read == self.nan_at:
            batch["x"][0, 0] = np.nan
        return batch

    def train_batch(
        self, *, worker: int, num_workers: int, step: int, batch_size: int
    ) -> dict[str, np.ndarray]:
        """The dataset protocol's batch; the runtime reads `examples` instead."""
        first = (step * num_workers + worker) * batch_size
        return self.examples((np.arange(batch_size) + first) % self.num_train)

    def test(self) -> dict[str, np.ndarray]:
        return self._rows(7, _TEST_EXAMPLES)


def _this_task() -> tuple[str, int] | None:
    """(type, index) of the task this process is, from ``TF_CONFIG``; None outside a job."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    task = json.loads(raw).get("task", {})
    return str(task.get("type", "")), int(task.get("index", 0))


def _line(marker: str) -> int:
    """The line of this file that ends with `# <marker>`: what a UserCodeError must name."""
    with open(__file__, encoding="utf-8") as source:
        return next(i for i, line in enumerate(source, 1) if line.rstrip().endswith(f"# {marker}"))


RAISES_LINE = _line("RAISES")
EVALUATE_RAISES_LINE = _line("EVALUATE")
INIT_RAISES_LINE = _line("INIT")


def _optional_count(kwargs: dict[str, Any], key: str) -> int | None:
    value = kwargs.pop(key, None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{key}: expected an integer >= 0, got {value!r}")
    return value


def make_model(**kwargs: Any) -> FaultyModel:
    """``features`` (default 8), ``evaluateRaises`` (false), ``initRaises`` (false),
    ``vectorLoss`` (false: the loss is one error per example, not their mean)."""
    model = FaultyModel(
        features=int(kwargs.pop("features", 8)),
        evaluate_raises=bool(kwargs.pop("evaluateRaises", False)),
        init_raises=bool(kwargs.pop("initRaises", False)),
        vector_loss=bool(kwargs.pop("vectorLoss", False)),
    )
    if kwargs:
        raise TypeError(f"unknown arguments {sorted(kwargs)}")
    return model


def make_dataset(**kwargs: Any) -> FaultyDataset:
    """``features`` (default 8), ``records`` (4096: more than the tests' jobs read in one data
    epoch), ``worker`` (0: the worker that misbehaves), the read of that worker that
    ``raiseAt``, ``nanAt``, ``blockAt`` or ``slowAt`` (each off by default), ``slowSeconds`` (0)
    and ``batchSeconds`` (0)."""
    records = _optional_count(kwargs, "records")
    dataset = FaultyDataset(
        features=int(kwargs.pop("features", 8)),
        records=4096 if records is None else max(records, 1),
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
