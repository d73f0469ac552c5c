"""Models and datasets by name: what a jaxps job trains, and on what.

A job names a model and a dataset (each with camelCase ``kwargs`` from the TrainingJob manifest)
and :func:`build_model` / :func:`build_dataset` turn them into objects the training loop drives.
Every configuration error raises :class:`ModelError`, whose message names the field (e.g.
``model.kwargs.hidden``), the offending value and what is allowed.

Built-in models (``catalog.MODELS``) and the dataset each trains on by default
(``catalog.DEFAULT_DATASET``); their keyword arguments, defaults and checks are in ``catalog``
(standard library only, so the operator checks them too):

* ``linear`` (``features``) on ``synthetic`` (``features``, ``examples``, ``testExamples``):
  least-squares regression; metrics ``loss``.
* ``mlp`` (``hidden``, ``inputs``: default the width of the dataset's ``x``, ``classes``) on
  ``digits`` (``testFraction``): a relu classifier on scikit-learn's bundled 8x8 digits;
  metrics ``loss``, ``accuracy``.
* ``embedding`` (``rows``, ``dim``, ``idsPerExample``) on ``sparse`` (``idRange``,
  ``idsPerExample``, ``examples``, ``testExamples``): a large embedding table read sparsely,
  binary labels; metrics ``loss``, ``accuracy``.

Your own model
--------------
Set ``model.module`` to ``"package.module:factory"``. The runtime imports ``package.module``
(it must be importable from ``PYTHONPATH``, e.g. baked into the image or mounted next to it),
calls ``factory(**model.kwargs)`` and uses what it returns; ``model.name`` is then only a label.
The object returned must have:

* ``sparse``: a mapping from the top-level parameter key of each embedding table to the batch
  key holding its int64 row ids; ``{}`` for a dense model.
* ``init(key) -> params``: the parameters, a pytree (nested dict) of jax arrays; deterministic
  given the ``jax.random`` key.
* ``loss(params, batch) -> scalar``: the training loss; must be jit-able.
* ``evaluate(params, batch) -> {metric: scalar}``: jit-able; always includes ``"loss"``.

The sparse rule: a step pulls only the rows of a table its batch uses. The training loop
replaces ``params[table]`` by those unique rows (shape ``[n_unique, dim]``) and
``batch[ids_key]`` by each id's position among them before calling ``loss``/``evaluate``, so a
model must read a table ONLY as ``params[table][batch[ids_key]]``.

The dataset is configured separately: a built-in, or the user's files (``jaxps_runtime.filedata``):

* ``arrays`` (``path``: an ``.npz`` file or a directory of ``.npy`` files, memory-mapped;
  ``test``: the same for the test set, else the last ``testFraction`` of the rows; ``keys``:
  ``{batch key: array name}``, default every array under its name);
* ``parquet`` (``path``: a Parquet file or a directory of them; ``columns``: ``{batch key:
  column}``, default every column; numeric or fixed-size-list columns; ``test``,
  ``testFraction`` as for ``arrays``);
* ``idx`` (``dir``: MNIST's or Fashion-MNIST's four IDX files, maybe gzipped): ``x`` float32
  ``[B, rows*cols]`` in [0, 1], ``y`` int32 ``[B]``, what ``mlp`` takes (784 inputs);
  ``fallback: digits`` trains on that built-in when ``dir`` holds none of the files (said in
  the log), so one manifest runs with and without them.

A Flax module (Linen or NNX) with a loss is a model too: ``jaxps_runtime.flaxmodel``.

Or your own: ``dataset.module: "package.module:factory"`` (leave ``name`` out); the runtime
calls ``factory(**dataset.kwargs)``, which returns either the arrays, ``{"train": {key: array},
"test": {key: array}}`` (jaxps shards, shuffles and resumes them as the built-ins; memory-mapped
arrays are read a batch at a time), or an object with ``train_batch(*, worker, num_workers,
step, batch_size)`` and ``test()`` (then a batch must be a function of those arguments, or a
restarted worker reads other data).

Its batches are ``{name: array}`` (``synthetic``: ``x`` float32 ``[B, features]``, ``y``
float32 ``[B]``).
``examples/user_model/quadratic.py`` is a complete example: with ``examples/user_model`` on
``PYTHONPATH``, ``module: "quadratic:make_model"`` trains it on ``synthetic``.

Datasets shard and shuffle deterministically: worker ``w`` of ``n`` reads only its shard of
the training set, in an order reshuffled every epoch from (seed, worker, epoch).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxps_runtime import catalog, flaxmodel

Params = Any
"""A pytree (nested dict) of jax arrays."""
Batch = dict[str, np.ndarray]
"""Named arrays with the same number of rows."""

_ZIPF_EXPONENT = 1.2
log = logging.getLogger(__name__)

ModelError = catalog.ModelError
"""Bad model or dataset configuration; the message names the field, the value and what is
allowed."""


@runtime_checkable
class Model(Protocol):
    """What the training loop trains; see the module docstring for the contract."""

    sparse: Mapping[str, str]

    def init(self, key: jax.Array) -> Params: ...

    def loss(self, params: Params, batch: Mapping[str, jax.Array]) -> jax.Array: ...

    def evaluate(self, params: Params, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]: ...


class Dataset(Protocol):
    """Deterministic, sharded training batches and a held-out set."""

    def train_batch(self, *, worker: int, num_workers: int, step: int, batch_size: int) -> Batch:
        """Exactly `batch_size` rows of worker `worker`'s shard; a function of (seed, worker,
        num_workers, step)."""
        ...

    def test(self) -> Batch:
        """The whole held-out set."""
        ...


# --- configuration checks ---------------------------------------------------------------------


def _check_columns(where: str, batch: Mapping[str, jax.Array], *, key: str, expected: int) -> None:
    """Shapes are static under jit, so a mismatch with the dataset fails at trace time, clearly."""
    array = batch[key]
    if array.ndim != 2 or array.shape[1] != expected:
        raise ModelError(
            f"{where}: the model expects {expected} columns in batch {key!r}, got shape "
            f"{tuple(array.shape)}; make it match the dataset"
        )


# --- models -----------------------------------------------------------------------------------


def _dense(key: jax.Array, *, fan_in: int, fan_out: int) -> dict[str, jax.Array]:
    """A layer as Keras initialises it: glorot-uniform kernel, zero bias."""
    kernel = jax.nn.initializers.glorot_uniform()(key, (fan_in, fan_out), jnp.float32)
    return {"kernel": kernel, "bias": jnp.zeros((fan_out,), jnp.float32)}


def _affine(layer: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ layer["kernel"] + layer["bias"]


class LinearModel:
    """Least squares: ``x @ kernel + bias`` against ``y``; batch keys ``x`` [B, features], ``y``."""

    def __init__(self, *, features: int = 16) -> None:
        self.features = features
        self.sparse: Mapping[str, str] = MappingProxyType({})

    def init(self, key: jax.Array) -> Params:
        return _dense(key, fan_in=self.features, fan_out=1)

    def loss(self, params: Params, batch: Mapping[str, jax.Array]) -> jax.Array:
        _check_columns("model.kwargs.features", batch, key="x", expected=self.features)
        errors = _affine(params, batch["x"])[:, 0] - batch["y"]
        return jnp.mean(errors**2)

    def evaluate(self, params: Params, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return {"loss": self.loss(params, batch)}


class MlpModel:
    """A relu classifier: ``hidden`` layers then ``classes`` logits; batch keys ``x``, ``y``.

    Parameters: ``{"hidden_0": {kernel, bias}, ..., "output": {kernel, bias}}``.
    """

    def __init__(
        self, *, hidden: Sequence[int] = (64,), inputs: int = 64, classes: int = 10
    ) -> None:
        self.hidden = tuple(hidden)
        self.inputs = inputs
        self.classes = classes
        self.sparse: Mapping[str, str] = MappingProxyType({})

    def init(self, key: jax.Array) -> Params:
        widths = (self.inputs, *self.hidden, self.classes)
        keys = jax.random.split(key, len(widths) - 1)
        names = [f"hidden_{i}" for i in range(len(self.hidden))] + ["output"]
        return {
            name: _dense(k, fan_in=fan_in, fan_out=fan_out)
            for name, k, fan_in, fan_out in zip(names, keys, widths[:-1], widths[1:], strict=True)
        }

    def _logits(self, params: Params, batch: Mapping[str, jax.Array]) -> jax.Array:
        _check_columns("model.kwargs.inputs", batch, key="x", expected=self.inputs)
        x = batch["x"]
        for i in range(len(self.hidden)):
            x = jax.nn.relu(_affine(params[f"hidden_{i}"], x))
        return _affine(params["output"], x)

    def loss(self, params: Params, batch: Mapping[str, jax.Array]) -> jax.Array:
        logits = self._logits(params, batch)
        losses: jax.Array = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return losses.mean()

    def evaluate(self, params: Params, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        logits = self._logits(params, batch)
        return {
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(),
            "accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == batch["y"]),
        }


class EmbeddingModel:
    """Binary classifier over the mean embedding of an example's ids; batch keys ``ids``, ``y``.

    Parameters: ``{"embedding": [rows, dim], "dense": {"kernel": [dim, 1], "bias": [1]}}``; the
    table is read only as ``params["embedding"][batch["ids"]]`` (``sparse = {"embedding":
    "ids"}``). The table starts at N(0, 0.01^2), the dense layer as Keras would.
    """

    def __init__(self, *, rows: int = 200_000, dim: int = 16, ids_per_example: int = 4) -> None:
        self.rows = rows
        self.dim = dim
        self.ids_per_example = ids_per_example
        self.sparse: Mapping[str, str] = MappingProxyType({"embedding": "ids"})

    def init(self, key: jax.Array) -> Params:
        table_key, dense_key = jax.random.split(key)
        table = 0.01 * jax.random.normal(table_key, (self.rows, self.dim), jnp.float32)
        return {"embedding": table, "dense": _dense(dense_key, fan_in=self.dim, fan_out=1)}

    def _logits(self, params: Params, batch: Mapping[str, jax.Array]) -> jax.Array:
        _check_columns(
            "model.kwargs.idsPerExample", batch, key="ids", expected=self.ids_per_example
        )
        pooled = params["embedding"][batch["ids"]].mean(axis=1)
        return _affine(params["dense"], pooled)[:, 0]

    def loss(self, params: Params, batch: Mapping[str, jax.Array]) -> jax.Array:
        losses: jax.Array = optax.sigmoid_binary_cross_entropy(
            self._logits(params, batch), batch["y"]
        )
        return losses.mean()

    def evaluate(self, params: Params, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        logits = self._logits(params, batch)
        return {
            "loss": optax.sigmoid_binary_cross_entropy(logits, batch["y"]).mean(),
            "accuracy": jnp.mean((logits > 0) == (batch["y"] > 0.5)),
        }


# --- datasets ---------------------------------------------------------------------------------


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

    def train_batch(self, *, worker: int, num_workers: int, step: int, batch_size: int) -> Batch:
        rows = self.train_indices(
            worker=worker, num_workers=num_workers, step=step, batch_size=batch_size
        )
        return {key: array[rows] for key, array in self._train.items()}

    def test(self) -> Batch:
        return dict(self._test)


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


# --- building by name -------------------------------------------------------------------------


def _width(batch: Batch, *, key: str, where: str) -> int:
    """The number of columns of `batch[key]`, for a model sized by its dataset."""
    array = batch.get(key)
    if array is None or np.ndim(array) != 2:
        shape = None if array is None else list(np.shape(array))
        raise ModelError(
            f"{where}: not set, and the dataset's {key!r} is {shape}, not [examples, columns] "
            "to take it from; set it"
        )
    return int(np.shape(array)[1])


def build_model(
    *,
    name: str,
    module: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    example: Callable[[], Batch] | None = None,
) -> Model:
    """The built-in model `name`, or, when `module` is set, ``factory(**kwargs)`` from
    ``module = "package.module:factory"`` (then `name` is only a label). `example` gives an
    example batch, for a Flax Linen module to initialise from."""
    if module is not None:
        return _user_model(module, kwargs, example=example)
    opts = catalog.check_model(name, kwargs)
    if name == "linear":
        return LinearModel(features=opts["features"])
    if name == "mlp":
        inputs = opts["inputs"]
        if inputs is None:  # the dataset's width
            inputs = _width(example(), key="x", where="model.kwargs.inputs") if example else 64
        return MlpModel(hidden=opts["hidden"], inputs=inputs, classes=opts["classes"])
    return EmbeddingModel(rows=opts["rows"], dim=opts["dim"], ids_per_example=opts["idsPerExample"])


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
        from jaxps_runtime import filedata  # noqa: PLC0415 (it builds on ArrayDataset)

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
    made = _from_factory(module, kwargs, field="dataset")
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


def _from_factory(module: str, kwargs: Mapping[str, Any] | None, *, field: str) -> Any:
    """``factory(**kwargs)`` of ``module = "package.module:factory"``; errors name
    `<field>.module` or `<field>.kwargs`."""
    where = f"{field}.module"
    expected = "expected 'package.module:factory', importable from PYTHONPATH"
    module_name, factory_path = catalog.check_module(module, where=where)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        raise ModelError(
            f"{where}: {module!r}: cannot import {module_name!r} "
            f"({type(err).__name__}: {err}); {expected}"
        ) from err
    for attr in factory_path.split("."):
        if not hasattr(obj, attr):
            raise ModelError(
                f"{where}: {module!r}: {module_name!r} has no attribute {factory_path!r}; "
                f"{expected}"
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ModelError(f"{where}: {module!r}: {factory_path!r} is not callable; {expected}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ModelError(f"{field}.kwargs: expected an object of keyword arguments, got {kwargs!r}")
    factory: Callable[..., Any] = obj
    try:
        return factory(**(kwargs or {}))
    except ModelError:
        raise
    except (TypeError, ValueError, OSError) as err:
        raise ModelError(f"{field}.kwargs: {module} refused them: {err}") from err


def _user_model(
    module: str, kwargs: Mapping[str, Any] | None, *, example: Callable[[], Batch] | None
) -> Model:
    where = "model.module"
    made = _from_factory(module, kwargs, field="model")
    if flaxmodel.is_flax(made):
        return flaxmodel.adapt(made, where=f"{where}: {module!r}", example=example)
    model: Model = made
    missing = [m for m in ("init", "loss", "evaluate") if not callable(getattr(model, m, None))]
    sparse = getattr(model, "sparse", None)
    if not isinstance(sparse, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in sparse.items()
    ):
        missing.append("sparse (a mapping of str to str)")
    if missing:
        raise ModelError(
            f"{where}: {module!r} returned a {type(model).__name__} lacking "
            f"{', '.join(missing)}; a model needs sparse, init, loss and evaluate (or return a "
            "Flax module and its loss: see jaxps_runtime.flaxmodel)"
        )
    return model
