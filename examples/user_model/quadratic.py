"""A user model for jaxps: quadratic regression on the ``synthetic`` dataset.

Predicts ``y`` from ``x`` (float32 ``[B, features]``) as
``x @ linear + (x * x) @ square + bias`` and trains on the mean squared error.

Use it in a TrainingJob with this directory on ``PYTHONPATH`` (baked into the image or mounted)::

    model:
      name: quadratic            # only a label when module is set
      module: quadratic:make_model
      kwargs: {features: 16}
    dataset:
      name: synthetic
      kwargs: {features: 16}

The runtime imports ``quadratic``, calls ``make_model(**kwargs)`` and trains what it returns.
A model needs ``sparse``, ``init``, ``loss`` and ``evaluate`` (see ``jaxps_runtime.model.builtin``);
this one is dense, so ``sparse`` is empty. It needs only jax, not jaxps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp


class QuadraticModel:
    """``y ~ x @ linear + (x * x) @ square + bias``; parameters start at zero."""

    def __init__(self, features: int) -> None:
        self.features = features
        self.sparse: Mapping[str, str] = {}  # no embedding tables

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """Zero parameters (`key` is unused: zero is a fine start for a convex loss)."""
        del key
        return {
            "linear": jnp.zeros((self.features,), jnp.float32),
            "square": jnp.zeros((self.features,), jnp.float32),
            "bias": jnp.zeros((1,), jnp.float32),
        }

    def loss(self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
        """Mean squared error over the batch (a scalar); jit-able."""
        x = batch["x"]
        prediction = x @ params["linear"] + (x * x) @ params["square"] + params["bias"][0]
        return jnp.mean((prediction - batch["y"]) ** 2)

    def evaluate(
        self, params: Mapping[str, jax.Array], batch: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        """Scalar metrics; the training loop requires ``"loss"``."""
        return {"loss": self.loss(params, batch)}


def make_model(**kwargs: Any) -> QuadraticModel:
    """The factory jaxps calls with ``model.kwargs``; accepts ``features`` (default 16).

    Raises TypeError for unknown arguments and ValueError for bad values; jaxps reports either
    as an error in ``model.kwargs``.
    """
    features = kwargs.pop("features", 16)
    if kwargs:
        raise TypeError(f"unknown arguments {sorted(kwargs)}; allowed: features")
    if isinstance(features, bool) or not isinstance(features, int) or features < 1:
        raise ValueError(f"features: expected an integer >= 1, got {features!r}")
    return QuadraticModel(features)
