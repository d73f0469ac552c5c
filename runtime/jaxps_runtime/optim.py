"""Optimizers for ps shards: any optax optimizer by name and keyword arguments.

Each shard has its own optax state, so element-wise optimizers (sgd, momentum, adagrad, adam,
rmsprop, ...) give exactly what they give on the whole tree. Optimizers that couple leaves
(clip_by_global_norm, lamb, lars) see one shard at a time; clip gradients on the worker instead.

`Applier` jits the update once per shard shape. Its functions are pure and thread-safe; callers
serialise read-modify-write of one shard's (value, state) themselves.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax


class OptimizerError(ValueError):
    """The optimizer configuration names no optax optimizer or passes it bad arguments."""


def _public_optimizers() -> list[str]:
    names = []
    for name in dir(optax):
        obj = getattr(optax, name)
        if name.startswith("_") or not inspect.isfunction(obj):
            continue
        params = inspect.signature(obj).parameters
        if "learning_rate" in params:
            names.append(name)
    return sorted(names)


@dataclass(frozen=True)
class OptimizerConfig:
    """An optax optimizer by function name, with its keyword arguments (JSON values)."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str, *, where: str = "optimizer") -> OptimizerConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise OptimizerError(f"{where}: not JSON ({err})") from err
        return cls.from_dict(raw, where=where)

    @classmethod
    def from_dict(cls, raw: object, *, where: str = "optimizer") -> OptimizerConfig:
        if not isinstance(raw, dict):
            raise OptimizerError(f"{where}: expected an object {{name, kwargs}}, got {raw!r}")
        unknown = sorted(set(raw) - {"name", "kwargs"})
        if unknown:
            raise OptimizerError(f"{where}: unknown key {unknown[0]!r}; allowed: name, kwargs")
        name, kwargs = raw.get("name"), raw.get("kwargs", {})
        if not isinstance(name, str) or not name:
            raise OptimizerError(f"{where}.name: expected an optax function name, got {name!r}")
        if not isinstance(kwargs, dict):
            raise OptimizerError(f"{where}.kwargs: expected an object, got {kwargs!r}")
        config = cls(name=name, kwargs=dict(kwargs))
        build(config, where=where)  # validate now, at the edge
        return config

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "kwargs": dict(self.kwargs)}, sort_keys=True)


def build(config: OptimizerConfig, *, where: str = "optimizer") -> optax.GradientTransformation:
    """The optax transformation `config` names; errors name the field and what is allowed."""
    fn = getattr(optax, config.name, None)
    if config.name.startswith("_") or not inspect.isfunction(fn):
        raise OptimizerError(
            f"{where}.name: {config.name!r} is not an optax optimizer; "
            f"allowed: {', '.join(_public_optimizers())}"
        )
    sig = inspect.signature(fn)
    for key in config.kwargs:
        if key not in sig.parameters:
            raise OptimizerError(
                f"{where}.kwargs.{key}: optax.{config.name} has no argument {key!r}; "
                f"allowed: {', '.join(sig.parameters)}"
            )
    try:
        sig.bind(**config.kwargs)
    except TypeError as err:
        raise OptimizerError(f"{where}.kwargs: optax.{config.name}: {err}") from err
    try:
        tx = fn(**config.kwargs)
    except (TypeError, ValueError) as err:
        raise OptimizerError(f"{where}.kwargs: optax.{config.name} refused them: {err}") from err
    if not isinstance(tx, optax.GradientTransformation):
        raise OptimizerError(
            f"{where}.name: optax.{config.name} returns {type(tx).__name__}, "
            "not a GradientTransformation"
        )
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

        def sparse(
            param: jax.Array, state: Any, ids: jax.Array, grad_rows: jax.Array
        ) -> tuple[jax.Array, Any]:
            # Padding ids equal param.shape[0]: gathers fill zeros there, scatters drop them.
            full = param.shape

            def rows(leaf: jax.Array) -> jax.Array:
                if leaf.shape != full:
                    return leaf
                return leaf.at[ids].get(mode="fill", fill_value=0)

            p_rows = rows(param)
            s_rows = jax.tree_util.tree_map(rows, state)
            updates, s_rows = tx.update(grad_rows, s_rows, p_rows)
            new_rows = optax.apply_updates(p_rows, updates)

            def scatter(leaf: jax.Array, new: jax.Array) -> jax.Array:
                if leaf.shape != full:
                    return new
                return leaf.at[ids].set(new, mode="drop")

            return scatter(param, new_rows), jax.tree_util.tree_map(scatter, state, s_rows)

        self.dense = jax.jit(dense)
        self._sparse = jax.jit(sparse)

    def init(self, param: jax.Array) -> Any:
        return self._tx.init(param)

    def sparse(
        self, param: jax.Array, state: Any, ids: np.ndarray, grad_rows: np.ndarray
    ) -> tuple[jax.Array, Any]:
        """Updates rows `ids` (unique) of `param` with `grad_rows`; other rows stay untouched."""
        n = ids.shape[0]
        size = _bucket(n)
        padded_ids = np.full(size, param.shape[0], dtype=np.int64)
        padded_ids[:n] = ids
        padded = np.zeros((size, *grad_rows.shape[1:]), dtype=grad_rows.dtype)
        padded[:n] = grad_rows
        return self._sparse(param, state, padded_ids, padded)  # type: ignore[no-any-return]


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
