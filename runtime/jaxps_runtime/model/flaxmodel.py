"""Flax modules as jaxps models: the user's factory returns a module and a loss, jaxps writes
``init``, ``loss`` and ``evaluate``.

What a ``model.module`` factory may return (besides a complete jaxps model):

* a Flax module: a ``flax.linen.Module`` or a ``flax.nnx.Module``, trained with the default
  loss, ``softmax_cross_entropy``;
* ``(module, loss)``;
* ``{"module": module, "loss": loss, "inputs": "x", "labels": "y", "metrics": fn}``, every key
  but ``module`` optional.

``loss`` is a name or a function ``loss(outputs, batch) -> scalar``:

* ``softmax_cross_entropy``: outputs ``[B, classes]`` logits, ``batch[labels]`` int class ids;
  metrics ``loss``, ``accuracy``;
* ``sigmoid_binary_cross_entropy``: outputs ``[B]`` or ``[B, 1]`` logits, labels in {0, 1};
  metrics ``loss``, ``accuracy``, ``auc``;
* ``mean_squared_error``: outputs ``[B]`` or ``[B, 1]``, float labels; metrics ``loss``.

With a function, the metrics are ``loss`` and whatever ``metrics(outputs, batch) -> {name:
scalar}`` adds. The module is called with ``batch[inputs]`` (or, for a list of keys, with each
of them as positional arguments).

Parameters: Linen's are ``module.init(key, <the first test example>)["params"]``, from the
job's ``seed``; NNX's are the ``nnx.Param``s of the module as the factory built it (make them
from a fixed ``nnx.Rngs`` seed: every task builds the model, the chief's values are trained).
Only parameters train; other state (Linen's ``batch_stats``, NNX's ``BatchStat``) stays as
initialised, so use a module in its inference form for such layers (``use_running_average=
True``), and no dropout. Embedding tables are dense variables here (a Flax ``Embed`` is updated
whole); for tables read sparsely, write the model by hand (see ``models``).

Flax is imported only when the user's factory returned something of Flax's, so the runtime
needs it only then (``pip install 'jaxps[flax]'`` or an image built on the runtime's).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxps_runtime.config import catalog
from jaxps_runtime.model.scores import auc

Batch = Mapping[str, jax.Array]
LOSSES = ("softmax_cross_entropy", "sigmoid_binary_cross_entropy", "mean_squared_error")


def _flax_class(obj: object) -> str | None:
    """'linen' or 'nnx' when `obj` is an instance of a Flax module class; else None."""
    for cls in type(obj).__mro__:
        where = f"{cls.__module__}.{cls.__qualname__}"
        if where == "flax.linen.module.Module":
            return "linen"
        if where.startswith("flax.nnx.") and cls.__qualname__ == "Module":
            return "nnx"
    return None


def is_flax(made: object) -> bool:
    """Whether a factory returned a Flax module, alone, with its loss, or in a dict."""
    if isinstance(made, tuple) and made:
        made = made[0]
    elif isinstance(made, Mapping) and "module" in made:
        made = made["module"]
    return _flax_class(made) is not None


class FlaxModel:
    """A Flax module and its loss as a jaxps `models.Model` (no sparse tables)."""

    sparse: Mapping[str, str] = {}

    def __init__(
        self,
        module: Any,
        *,
        loss: str | Callable[[jax.Array, Batch], jax.Array],
        inputs: Sequence[str],
        labels: str,
        metrics: Callable[[jax.Array, Batch], Mapping[str, jax.Array]] | None,
        example: Callable[[], Mapping[str, Any]] | None,
        where: str,
    ) -> None:
        self.kind = _flax_class(module)
        self.module, self.inputs, self.labels = module, tuple(inputs), labels
        self._loss, self._metrics, self._where = loss, metrics, where
        if self.kind == "nnx":
            nnx = importlib.import_module("flax.nnx")
            self._graph, params, self._rest = nnx.split(module, nnx.Param, ...)
            self._params = nnx.to_pure_dict(params)  # nested dicts of arrays
            self._merge = nnx.merge
            return
        if example is None:
            raise catalog.ModelError(
                f"{where}: a Linen module needs an example input to initialise from, and the "
                "dataset gave none"
            )
        self._example = {k: jnp.asarray(v) for k, v in example().items()}
        # Collections other than params (batch_stats, ...) stay as initialised: taken once
        # here, outside any trace, by every task (only the chief's params are used).
        shapes = jax.eval_shape(self._init_all, jax.random.PRNGKey(0))
        if "params" not in shapes:
            raise catalog.ModelError(f"{where}: the Linen module has no parameters")
        self._rest_vars: dict[str, Any] = {}
        if set(shapes) != {"params"}:
            variables = self._init_all(jax.random.PRNGKey(0))
            self._rest_vars = {k: v for k, v in variables.items() if k != "params"}

    def _init_all(self, key: jax.Array) -> Any:
        return self.module.init(key, *self._args(self._example))

    def _args(self, batch: Batch) -> list[Any]:
        missing = [k for k in (*self.inputs, self.labels) if k not in batch]
        if missing:
            raise catalog.ModelError(
                f"{self._where}: the batch has no key {missing[0]!r} (it has "
                f"{sorted(batch)}); set 'inputs'/'labels' in what the factory returns"
            )
        return [batch[k] for k in self.inputs]

    def init(self, key: jax.Array) -> Any:
        if self.kind == "nnx":
            return jax.tree_util.tree_map(jnp.asarray, self._params)
        return self._init_all(key)["params"]

    def apply(self, params: Any, batch: Batch) -> jax.Array:
        """The module's outputs on a batch with these parameters."""
        outputs: jax.Array
        if self.kind == "nnx":
            model = self._merge(self._graph, params, self._rest)
            outputs = model(*self._args(batch))
        else:
            outputs = self.module.apply({"params": params, **self._rest_vars}, *self._args(batch))
        return outputs

    def loss(self, params: Any, batch: Batch) -> jax.Array:
        loss: jax.Array = self._loss_and_metrics(params, batch, metrics=False)["loss"]
        return loss

    def evaluate(self, params: Any, batch: Batch) -> dict[str, jax.Array]:
        return self._loss_and_metrics(params, batch, metrics=True)

    def _loss_and_metrics(self, params: Any, batch: Batch, *, metrics: bool) -> dict[str, Any]:
        outputs = self.apply(params, batch)
        labels = batch[self.labels]
        if callable(self._loss):
            out = {"loss": jnp.asarray(self._loss(outputs, batch))}
            if metrics and self._metrics is not None:
                out.update({k: jnp.asarray(v) for k, v in self._metrics(outputs, batch).items()})
            return out
        if self._loss == "softmax_cross_entropy":
            out = {
                "loss": optax.softmax_cross_entropy_with_integer_labels(
                    outputs, labels.astype(jnp.int32)
                ).mean()
            }
            if metrics:
                out["accuracy"] = (outputs.argmax(-1) == labels).mean()
            return out
        flat = outputs.reshape(labels.shape)
        if self._loss == "sigmoid_binary_cross_entropy":
            out = {
                "loss": optax.sigmoid_binary_cross_entropy(flat, labels.astype(flat.dtype)).mean()
            }
            if metrics:
                out["accuracy"] = ((flat > 0) == (labels > 0.5)).mean()
                out["auc"] = auc(flat, labels)
            return out
        return {"loss": jnp.mean((flat - labels.astype(flat.dtype)) ** 2)}


def adapt(
    made: object, *, where: str, example: Callable[[], Mapping[str, Any]] | None
) -> FlaxModel:
    """The jaxps model for what a factory returned (`is_flax(made)` holds); errors name
    `where` and the part at fault."""
    spec: dict[str, Any]
    if isinstance(made, tuple):
        if len(made) != 2:
            raise catalog.ModelError(
                f"{where}: returned a tuple of {len(made)}; expected (module, loss)"
            )
        spec = {"module": made[0], "loss": made[1]}
    elif isinstance(made, Mapping):
        unknown = sorted(set(made) - {"module", "loss", "inputs", "labels", "metrics"})
        if unknown:
            raise catalog.ModelError(
                f"{where}: unknown key {unknown[0]!r} in what the factory returned; allowed: "
                "module, loss, inputs, labels, metrics"
            )
        spec = dict(made)
    else:
        spec = {"module": made}
    loss = spec.get("loss", "softmax_cross_entropy")
    if not callable(loss) and loss not in LOSSES:
        raise catalog.ModelError(
            f"{where}: loss {loss!r} is neither a function loss(outputs, batch) nor one of "
            f"{', '.join(LOSSES)}"
        )
    inputs = spec.get("inputs", "x")
    inputs = [inputs] if isinstance(inputs, str) else inputs
    if not inputs or not all(isinstance(k, str) for k in inputs):
        raise catalog.ModelError(
            f"{where}: inputs {spec.get('inputs')!r}: expected a batch key or a list of them"
        )
    labels = spec.get("labels", "y")
    if not isinstance(labels, str):
        raise catalog.ModelError(f"{where}: labels {labels!r}: expected a batch key")
    metrics = spec.get("metrics")
    if metrics is not None and not callable(metrics):
        raise catalog.ModelError(
            f"{where}: metrics {metrics!r}: expected a function metrics(outputs, batch)"
        )
    return FlaxModel(
        spec["module"],
        loss=loss,
        inputs=list(inputs),
        labels=labels,
        metrics=metrics,
        example=example,
        where=where,
    )
