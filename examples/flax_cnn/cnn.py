"""A small convolutional network in Flax, trained by jaxps as it is: the factory returns the
module and its loss, and jaxps writes init, loss and evaluate (``jaxps_runtime.model.flaxmodel``).

Batches hold flat images ``x`` [B, side*side] (MNIST's 784 pixels from IDX files, or the
built-in digits' 64) and int labels ``y``; the network reshapes them into square images.
``make`` gives the Linen module, ``make_nnx`` the same network in NNX.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx


def _square(x: jax.Array) -> jax.Array:
    side = math.isqrt(x.shape[-1])
    if side * side != x.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} columns, not a square image's")
    return x.reshape(x.shape[0], side, side, 1)


class CNN(nn.Module):
    """Two 3x3 convolutions (the second strided), then a dense layer to the class logits."""

    features: int = 16
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.relu(nn.Conv(self.features, (3, 3))(_square(x)))
        h = nn.relu(nn.Conv(2 * self.features, (3, 3), strides=(2, 2))(h))
        return nn.Dense(self.classes)(h.reshape(h.shape[0], -1))


def make(features: int = 16, classes: int = 10) -> tuple[nn.Module, str]:
    """The Linen CNN and its loss (softmax cross-entropy on int labels: metrics loss and
    accuracy)."""
    return CNN(features=features, classes=classes), "softmax_cross_entropy"


class NnxCNN(nnx.Module):
    """The same network in NNX, sized for `side` x `side` images."""

    def __init__(self, *, side: int, features: int, classes: int, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, features, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(features, 2 * features, (3, 3), strides=(2, 2), rngs=rngs)
        self.out = nnx.Linear(2 * features * math.ceil(side / 2) ** 2, classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.conv1(_square(x)))
        h = jax.nn.relu(self.conv2(h))
        return self.out(h.reshape(h.shape[0], -1))


def make_nnx(side: int = 8, features: int = 16, classes: int = 10, seed: int = 0) -> dict:
    """The NNX CNN (its parameters from `seed`), with the loss and batch keys spelled out."""
    module = NnxCNN(side=side, features=features, classes=classes, rngs=nnx.Rngs(seed))
    return {"module": module, "loss": "softmax_cross_entropy", "inputs": "x", "labels": "y"}


def accuracy_percent(logits: jax.Array, batch: dict) -> dict:
    """An extra metric, for a loss given as a function."""
    return {"accuracy_percent": 100 * jnp.mean(logits.argmax(-1) == batch["y"])}
