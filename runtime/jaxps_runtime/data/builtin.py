"""Datasets by name: the built-ins (``synthetic``, ``digits``, ``sparse``), the user's files
(``arrays``, ``parquet``, ``idx``: `data.files`) and the user's own factory; see
`jaxps_runtime.model.builtin` for the whole contract of models and datasets."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxps_runtime.config import catalog
from jaxps_runtime.data import files as filedata
from jaxps_runtime.data.arrays import ArrayDataset, Dataset, ModelError
from jaxps_runtime.data.factory import from_factory

_ZIPF_EXPONENT = 1.2
log = logging.getLogger(__name__)


class SyntheticDataset(ArrayDataset):
    """Regression: ``x ~ N(0, 1)`` [n, features], ``y = x @ w + b + 0.01 noise``, w and b fixed
    by the seed. Keys ``x`` float32 [n, features], ``y`` float32 [n]."""

    def __init__(self, *, features: int, examples: int, test_examples: int, seed: int) -> None:
        rng = np.random.default_rng([seed, 0x5E17])
        w = rng.standard_normal(features)
        b = rng.standard_normal()
        x = rng.standard_normal((examples + test_examples, features))
        y = x @ w + b + 0.01 * rng.standard_normal(len(x))
        x, y = x.astype(np.float32), y.astype(np.float32)
        super().__init__(
            train={"x": x[:examples], "y": y[:examples]},
            test={"x": x[examples:], "y": y[examples:]},
            seed=seed,
        )


class DigitsDataset(ArrayDataset):
    """scikit-learn's bundled 8x8 digits (1797 images, offline). Keys ``x`` float32 [n, 64] in
    [0, 1], ``y`` int32 [n] in 0..9; the split is stratified by class and fixed by the seed."""

    def __init__(self, *, test_fraction: float, seed: int) -> None:
        from sklearn.datasets import load_digits  # noqa: PLC0415

        digits = load_digits()
        x = (np.asarray(digits.data) / 16.0).astype(np.float32)
        y = np.asarray(digits.target).astype(np.int32)
        rng = np.random.default_rng([seed, 0xD161])
        order = rng.permutation(len(y))
        in_test = np.zeros(len(y), bool)
        for label in np.unique(y):
            members = order[y[order] == label]
            in_test[members[: round(test_fraction * len(members))]] = True
        train, test = order[~in_test[order]], order[in_test[order]]
        if not len(train) or not len(test):
            raise ModelError(
                f"dataset.kwargs.testFraction: {test_fraction} leaves an empty train or test set"
            )
        super().__init__(
            train={"x": x[train], "y": y[train]}, test={"x": x[test], "y": y[test]}, seed=seed
        )


class SparseDataset(ArrayDataset):
    """Categorical data for the embedding model. Keys ``ids`` int64 [n, ids_per_example] and
    ``y`` float32 [n] in {0, 1}.

    Ids follow a Zipf-like law over ``[0, id_range)`` (rank r has weight ``(r + 1) ** -1.2``;
    ranks map to ids by a seeded permutation, so hot ids are spread over the table). Each id has
    a hidden score ~ N(0, 1) from the seed; an example is positive when the sum of its ids'
    scores exceeds the median sum (so the classes are balanced).
    """

    def __init__(
        self, *, id_range: int, ids_per_example: int, examples: int, test_examples: int, seed: int
    ) -> None:
        rng = np.random.default_rng([seed, 0x5A45])
        self.id_range = id_range
        weights = np.arange(1, id_range + 1, dtype=np.float64) ** -_ZIPF_EXPONENT
        cdf = np.cumsum(weights / weights.sum())
        ranks = np.searchsorted(cdf, rng.random((examples + test_examples, ids_per_example)))
        ids = rng.permutation(id_range)[np.minimum(ranks, id_range - 1)].astype(np.int64)
        sums = rng.standard_normal(id_range)[ids].sum(axis=1)
        y = (sums > np.median(sums)).astype(np.float32)
        super().__init__(
            train={"ids": ids[:examples], "y": y[:examples]},
            test={"ids": ids[examples:], "y": y[examples:]},
            seed=seed,
        )


def build_dataset(
    *,
    name: str,
    module: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> Dataset:
    """The built-in dataset `name` (its split, generated values and batch order follow `seed`),
    or, when `module` is set, the user's (`_user_dataset`; then `name` is only a label)."""
    seed = catalog.count("seed", seed, minimum=0)
    if module is not None:
        return _user_dataset(module, kwargs, seed=seed)
    opts = catalog.check_dataset(name, kwargs)
    if name == "synthetic":
        return SyntheticDataset(
            features=opts["features"],
            examples=opts["examples"],
            test_examples=opts["testExamples"],
            seed=seed,
        )
    if name == "digits":
        return DigitsDataset(test_fraction=opts["testFraction"], seed=seed)
    if name in catalog.FILE_DATASETS:
        if name == "idx" and opts["fallback"] and not filedata.has_idx_files(opts["dir"]):
            log.warning(
                "dataset.kwargs.dir: no MNIST IDX files in %s (put %s there, each may end "
                ".gz); training on the built-in %r instead (dataset.kwargs.fallback)",
                Path(opts["dir"]).resolve(),
                ", ".join(filedata.MNIST_FILES.values()),
                opts["fallback"],
            )
            return build_dataset(name=opts["fallback"], seed=seed)
        return filedata.build(name, opts, seed=seed)
    return SparseDataset(
        id_range=opts["idRange"],
        ids_per_example=opts["idsPerExample"],
        examples=opts["examples"],
        test_examples=opts["testExamples"],
        seed=seed,
    )


def _user_dataset(module: str, kwargs: Mapping[str, Any] | None, *, seed: int) -> Dataset:
    """``factory(**kwargs)`` returns either the arrays, ``{"train": {key: array}, "test": {key:
    array}}`` (jaxps then shards, shuffles and resumes them as the built-ins), or an object with
    ``train_batch(*, worker, num_workers, step, batch_size)`` and ``test()`` (the `Dataset`
    protocol: then a batch must be a function of those arguments, or a restart reads other
    data)."""
    made = from_factory(module, kwargs, field="dataset")
    where = f"dataset.module: {module!r}"
    if callable(getattr(made, "train_batch", None)) and callable(getattr(made, "test", None)):
        dataset: Dataset = made
        return dataset
    if not isinstance(made, Mapping) or set(made) != {"train", "test"}:
        raise ModelError(
            f"{where} returned a {type(made).__name__}; expected {{'train': {{key: array}}, "
            "'test': {key: array}} or an object with train_batch(...) and test()"
        )
    splits: dict[str, dict[str, np.ndarray]] = {}
    for split in ("train", "test"):
        arrays = made[split]
        if not isinstance(arrays, Mapping) or not arrays:
            raise ModelError(f"{where}: its {split!r} is not a non-empty mapping of arrays")
        splits[split] = {str(k): np.asarray(v) for k, v in arrays.items()}
        lengths = {k: len(v) if v.ndim else 0 for k, v in splits[split].items()}
        if len(set(lengths.values())) > 1 or 0 in lengths.values():
            raise ModelError(
                f"{where}: the {split} arrays differ in rows or are empty ({lengths}); every "
                "array is one value per example"
            )
    if set(splits["train"]) != set(splits["test"]):
        raise ModelError(
            f"{where}: train has keys {sorted(splits['train'])}, test {sorted(splits['test'])}"
        )
    return ArrayDataset(train=splits["train"], test=splits["test"], seed=seed)
