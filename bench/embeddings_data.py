"""bench/embeddings.py's dataset: a stream of ids for the built-in `embedding` model.

    dataset: {module: "embeddings_data:make", kwargs: {idsPerExample: 8, idRange: 0}}

Batch `b` (the job reads a dataset without `examples` as one endless stream: batch b is
`train_batch(worker=0, num_workers=1, step=b)`) holds the ids of counters
`[b * n, (b + 1) * n)`, n = batch size x ids per example, each through a 64-bit mixer (a
bijection): with `idRange` 0 every id of the run is a distinct int64 (negative ones included),
so a run of S steps streams exactly S x n distinct ids; with `idRange` R > 0 the ids are the
mixed counters modulo R (a fixed table's `[0, R)`). The label of an example is a bit of its
first counter's mix: no signal, this is a throughput and memory benchmark. The held-out set is
`testExamples` examples from counters no training batch uses.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SALT = np.uint64(0x243F6A8885A308D3)  # not the runtime's owner or admission salts
TEST_BASE = 1 << 62  # the held-out set's counters: past any training batch's


def mix(counters: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of each counter (salted): distinct counters, distinct outputs."""
    with np.errstate(over="ignore"):
        z = (counters.astype(np.uint64) ^ _SALT) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class IdStream:
    """The Dataset protocol (`train_batch`, `test`); keys ``ids`` int64 [n, ids_per_example]
    and ``y`` float32 [n]."""

    def __init__(self, *, ids_per_example: int, id_range: int, test_examples: int) -> None:
        if ids_per_example < 1 or id_range < 0 or test_examples < 1:
            raise ValueError(
                f"idsPerExample {ids_per_example} (>= 1), idRange {id_range} (>= 0) and "
                f"testExamples {test_examples} (>= 1)"
            )
        self.ids_per_example = ids_per_example
        self.id_range = id_range
        self.test_examples = test_examples

    def _examples(self, first: int, examples: int) -> dict[str, np.ndarray]:
        k = self.ids_per_example
        counters = np.arange(first, first + examples * k, dtype=np.uint64)
        mixed = mix(counters)
        ids = (
            (mixed % np.uint64(self.id_range)).astype(np.int64)
            if self.id_range
            else mixed.view(np.int64)
        )
        y = (mixed[::k] >> np.uint64(63)).astype(np.float32)
        return {"ids": ids.reshape(examples, k), "y": y}

    def train_batch(
        self, *, worker: int, num_workers: int, step: int, batch_size: int
    ) -> dict[str, np.ndarray]:
        index = step * num_workers + worker
        return self._examples(index * batch_size * self.ids_per_example, batch_size)

    def test(self) -> dict[str, np.ndarray]:
        return self._examples(TEST_BASE, self.test_examples)


def make(idsPerExample: int = 8, idRange: int = 0, testExamples: int = 1024) -> IdStream:  # noqa: N803 - manifest spelling
    return IdStream(
        ids_per_example=int(idsPerExample), id_range=int(idRange), test_examples=int(testExamples)
    )
