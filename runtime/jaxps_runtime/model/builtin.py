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

The dataset is configured separately: a built-in, or the user's files (``data.files``):

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

A Flax module (Linen or NNX) with a loss is a model too: ``jaxps_runtime.model.flaxmodel``.

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

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxps_runtime.config import catalog
from jaxps_runtime.data.arrays import Batch
from jaxps_runtime.data.factory import from_factory
from jaxps_runtime.model import flaxmodel

Params = Any
"""A pytree (nested dict) of jax arrays."""

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


# --- configuration checks ---------------------------------------------------------------------


def _check_columns(where: str, batch: Mapping[str, jax.Array], *, key: str, expected: int) -> None:
    """Shapes are static under jit, so a mismatch with the dataset fails at trace time, clearly."""
    array = batch[key]
    if array.ndim != 2 or array.shape[1] != expected:
        raise ModelError(
            f"{where}: the model expects {expected} columns in batch {key!r}, got shape "
            f"{tuple(array.shape)}; make it match the dataset"
        )


def label_problem(model: object, batch: Mapping[str, Any]) -> str | None:
    """What makes a batch's labels wrong for a built-in classifier (`mlp`: integer labels
    0..classes-1; optax's cross-entropy would read another as a wrong class, or as NaN), or
    None. Host-side, on the batch's numpy labels: a few microseconds a batch."""
    if not isinstance(model, MlpModel) or "y" not in batch:
        return None
    labels = np.asarray(batch["y"])
    if labels.size == 0:
        return None
    if labels.dtype.kind not in "iu":
        return f"labels of dtype {labels.dtype}; model mlp takes integer class labels"
    low, high = int(labels.min()), int(labels.max())
    if low >= 0 and high < model.classes:
        return None
    bad = low if low < 0 else high
    return (
        f"a label {bad}, but model mlp has {model.classes} classes (labels 0.."
        f"{model.classes - 1}): set training.model.kwargs.classes, or fix the labels"
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


def _user_model(
    module: str, kwargs: Mapping[str, Any] | None, *, example: Callable[[], Batch] | None
) -> Model:
    where = "model.module"
    made = from_factory(module, kwargs, field="model")
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
            "Flax module and its loss: see jaxps_runtime.model.flaxmodel)"
        )
    return model
