"""Wide & Deep on a Criteo-layout click log: what parameter servers exist for.

Batch keys, as in Criteo's Display Advertising Challenge: ``label`` (0/1), ``I1``..``I13``
(integer counts, heavy-tailed) and ``C1``..``C26`` (categorical ids, int64). Each categorical
column has its own embedding table, of very different sizes (``cardinalities``): the largest
has millions of rows and is split over the ps; a step pulls and pushes only the rows its batch
uses (``sparse``: each table is read only as ``params[table][batch[column]]``).

Each table row is ``dim + 1`` wide: ``dim`` for the deep tower and one wide (linear) weight.
The logit is wide (the rows' wide weights, a linear term of the dense features and a bias) plus
deep (an MLP over the log-scaled dense features and the 26 embeddings).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxps_runtime.model.scores import auc

DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
# Criteo-like spread: one table of millions of rows, a few large, many tiny.
CARDINALITIES = [
    2_000_000, 400_000, 100_000, 50_000, 20_000, 10_000, 5_000, 2_000, 1_000, 500, 300, 200,
    100, 100, 50, 30, 20, 10, 10, 5, 4, 3, 3, 2, 2, 2,
]  # fmt: skip


class WideDeep:
    def __init__(self, *, cardinalities: Sequence[int], dim: int, hidden: Sequence[int]) -> None:
        if len(cardinalities) != len(CATEGORICAL):
            raise ValueError(f"cardinalities: {len(cardinalities)} given, one per C1..C26 needed")
        self.cardinalities, self.dim, self.hidden = list(cardinalities), dim, list(hidden)
        self.sparse: Mapping[str, str] = {c: c for c in CATEGORICAL}

    def init(self, key: jax.Array) -> dict[str, jax.Array | dict[str, jax.Array]]:
        keys = iter(jax.random.split(key, len(CATEGORICAL) + len(self.hidden) + 1))
        params: dict[str, jax.Array | dict[str, jax.Array]] = {
            column: 0.05 * jax.random.normal(next(keys), (rows, self.dim + 1))
            for column, rows in zip(CATEGORICAL, self.cardinalities, strict=True)
        }
        widths = [len(DENSE) + len(CATEGORICAL) * self.dim, *self.hidden, 1]
        tower: dict[str, jax.Array] = {"wide": jnp.zeros(len(DENSE)), "bias": jnp.zeros(())}
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            tower[f"kernel_{i}"] = (
                jax.random.normal(next(keys), (fan_in, fan_out)) * (2.0 / fan_in) ** 0.5
            )
            tower[f"bias_{i}"] = jnp.zeros(fan_out)
        params["tower"] = tower
        return params

    def logits(self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        dense = jnp.log1p(jnp.stack([batch[k] for k in DENSE], axis=1).astype(jnp.float32))
        rows = [params[c][batch[c]] for c in CATEGORICAL]  # the sparse rule
        tower = params["tower"]
        wide = sum(r[:, -1] for r in rows) + dense @ tower["wide"] + tower["bias"]
        h = jnp.concatenate([dense, *(r[:, :-1] for r in rows)], axis=1)
        for i in range(len(self.hidden) + 1):
            h = h @ tower[f"kernel_{i}"] + tower[f"bias_{i}"]
            if i < len(self.hidden):
                h = jax.nn.relu(h)
        return wide + h[:, 0]

    def loss(self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        logits = self.logits(params, batch)
        labels = batch["label"].astype(jnp.float32)
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    def evaluate(
        self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        logits = self.logits(params, batch)
        labels = batch["label"].astype(jnp.float32)
        return {
            "loss": optax.sigmoid_binary_cross_entropy(logits, labels).mean(),
            "accuracy": ((logits > 0) == (labels > 0.5)).mean(),
            "auc": auc(logits, labels),
        }


def make(
    cardinalities: Sequence[int] = CARDINALITIES, dim: int = 8, hidden: Sequence[int] = (64, 32)
) -> WideDeep:
    return WideDeep(cardinalities=cardinalities, dim=dim, hidden=hidden)
