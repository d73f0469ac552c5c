"""A user's loop with a per-variable optimizer (`program.session(optimizers=...)`): least squares
y = x @ w + b on the job's synthetic data, where `w` is trained by the job's optimizer and
`b` by SGD at learning rate 1e-12, which must leave it exactly as initialised (its steps are
below half a float32 ulp of 0.5; adam would move it by ~0.01 a step)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxps_runtime.train import program

B0 = 0.5


def loss_fn(params: Any, batch: Any) -> jax.Array:
    predicted = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((predicted - batch["y"]) ** 2)


def main() -> None:
    features = program.dataset().test()["x"].shape[1]
    variables = {"w": np.zeros(features, np.float32), "b": np.full((), B0, np.float32)}
    grad = jax.jit(jax.value_and_grad(loss_fn))
    frozen = {"b": {"name": "sgd", "kwargs": {"learning_rate": 1e-12}}}  # below 0.5's ulp
    with program.session(variables, optimizers=frozen) as sess:
        while not sess.should_stop():
            batch = sess.next_batch()
            if batch is None:
                continue
            loss, grads = grad(sess.params(), batch)
            sess.push_tree(grads, loss=loss)
