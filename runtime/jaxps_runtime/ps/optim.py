"""Optimizers for ps shards: any optax optimizer by name and keyword arguments.

A job names its optimizer in `config.OptimizerConfig`, checked once, where it is read, against
the optax functions with a `learning_rate` and what a manifest may give their arguments
(`catalog.optimizers()`); `build` makes it. Each shard has its own optax
state, so element-wise optimizers (sgd, momentum, adagrad, adam, rmsprop, ...) give exactly what
they give on the whole tree. Optimizers that couple leaves (lamb, lars) see one shard at a time.

`Applier` jits the update once per shard shape. Its functions are pure and thread-safe; callers
serialise read-modify-write of one shard's (value, state) themselves.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from jaxps_runtime.config import catalog
from jaxps_runtime.config.sections import OptimizerConfig

OptimizerError = catalog.OptimizerError
"""The optimizer configuration names no optax optimizer or passes it bad arguments."""


def build(config: OptimizerConfig, *, where: str = "optimizer") -> optax.GradientTransformation:
    """The optax transformation `config` names; errors name the field.

    `config` is checked already: `OptimizerConfig.from_dict` (a job's configuration, a ps's
    Init from the wire alike) found its name in the optimizer table, every argument a
    parameter of it of the type and range the table allows, the required ones given; the table
    is the installed optax's (`make verify`). What is left is what only optax judges when it
    is called (a dtype it does not understand): at task start (`roles`) and at a ps's Init,
    before any shard is made."""
    function = getattr(optax, config.name, None)
    if function is None:  # an image whose optax is not the table's
        raise OptimizerError(
            f"{where}.name: optax.{config.name} is not in the installed optax "
            f"{optax.__version__}: the optimizer table was made from another optax"
        )
    try:
        tx: optax.GradientTransformation = function(**config.kwargs)
    except (TypeError, ValueError) as err:
        raise OptimizerError(f"{where}.kwargs: optax.{config.name} refused them: {err}") from err
    return tx


def _bucket(n: int) -> int:
    """Row counts are padded to powers of two so the sparse update compiles a few times only."""
    return 1 << max(n - 1, 0).bit_length()


class Applier:
    """Jitted dense and sparse updates of one shard with one optax transformation."""

    def __init__(self, tx: optax.GradientTransformation) -> None:
        self._tx = tx

        def dense(param: jax.Array, state: Any, grad: jax.Array) -> tuple[jax.Array, Any]:
            updates, state = tx.update(grad, state, param)
            return optax.apply_updates(param, updates), state

        # A sparse update is the same update of the rows alone (jit compiles it per row count).
        self.dense = jax.jit(dense)

    def init(self, param: jax.Array) -> Any:
        return self._tx.init(param)

    def sparse_rows(
        self, param: np.ndarray, state: Any, ids: np.ndarray, grad_rows: np.ndarray
    ) -> tuple[np.ndarray, Any]:
        """The new values of rows `ids` (unique) of `param`, and the new optimizer state of
        those rows (state leaves shaped like `param` are cut to the rows; others, such as a
        step count, stay whole): optax's update of the rows alone, as TensorFlow's sparse
        apply ops compute it. Nothing is written: `scatter` does that."""
        n = ids.shape[0]
        padded = np.full(_bucket(n), ids[0] if n else 0, dtype=np.int64)  # extra rows: dropped
        padded[:n] = ids
        grads = np.zeros((padded.size, *grad_rows.shape[1:]), dtype=grad_rows.dtype)
        grads[:n] = grad_rows
        full = param.shape

        def cut(leaf: Any) -> Any:
            return np.asarray(leaf)[padded] if np.shape(leaf) == full else leaf

        new_rows, new_state = self.dense(param[padded], jax.tree_util.tree_map(cut, state), grads)
        return np.asarray(new_rows)[:n], new_state

    @staticmethod
    def scatter(
        param: np.ndarray, state: Any, ids: np.ndarray, new_rows: np.ndarray, new_state: Any
    ) -> Any:
        """Writes what `sparse_rows` computed into `param` and `state` in place (host arrays
        shaped like `param`); returns the state, its whole leaves replaced by the new ones."""
        full, n = param.shape, ids.shape[0]
        param[ids] = new_rows

        def put(leaf: Any, new: Any) -> Any:
            if np.shape(leaf) != full:
                return new
            leaf[ids] = np.asarray(new)[:n]
            return leaf

        return jax.tree_util.tree_map(put, state, new_state)

    def sparse(self, param: np.ndarray, state: Any, ids: np.ndarray, grad_rows: np.ndarray) -> Any:
        """Updates rows `ids` (unique) of host arrays `param` and `state` in place; other rows
        stay untouched. Returns the state (see `scatter`)."""
        new_rows, new_state = self.sparse_rows(param, state, ids, grad_rows)
        return self.scatter(param, state, ids, new_rows, new_state)


def host_copy(param: Any, state: Any) -> tuple[np.ndarray, Any]:
    """Writable host copies of a shard and of its state leaves shaped like it (the others,
    such as a step count, are shared): what in-place row updates work on."""
    full = np.shape(param)

    def copy(leaf: Any) -> Any:
        return np.array(leaf) if np.shape(leaf) == full else leaf

    return np.array(param), jax.tree_util.tree_map(copy, state)


def sum_duplicate_rows(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique row ids (sorted) and the gradient rows summed per id."""
    if ids.size == 0:
        return ids, grads
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    if starts.size == ids.size:
        return sorted_ids, grads[order]
    return sorted_ids[starts], np.add.reduceat(grads[order], starts, axis=0)
