"""A user's loop over an embedding table read and updated by rows: the built-in `embedding`
model's classifier (the mean of an example's ids' embeddings, then a dense layer), written as a
program on the job's `sparse` dataset. The table has an optimizer of its own (adagrad, as the
recommender's per-table learning rate), the dense layer the job's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxps_runtime.train import program

ROWS, DIM = 200_000, 16
TABLE = "['embedding']"  # the variable's name, as the runtime names a tree's leaves


def logits(params: Any, ids: jax.Array) -> jax.Array:
    pooled = params["embedding"][ids].mean(axis=1)
    out: jax.Array = (pooled @ params["dense"]["kernel"] + params["dense"]["bias"])[:, 0]
    return out


def loss_fn(params: Any, batch: Any) -> jax.Array:
    losses = optax.sigmoid_binary_cross_entropy(logits(params, batch["ids"]), batch["y"])
    mean: jax.Array = losses.mean()
    return mean


def evaluate(params: Any, batch: Any) -> dict[str, jax.Array]:
    predicted = logits(params, batch["ids"]) > 0
    return {"accuracy": jnp.mean(predicted == (batch["y"] > 0.5))}


def main() -> None:
    key = jax.random.PRNGKey(program.training().seed)
    variables = {
        "embedding": np.asarray(0.01 * jax.random.normal(key, (ROWS, DIM), jnp.float32)),
        "dense": {"kernel": np.zeros((DIM, 1), np.float32), "bias": np.zeros(1, np.float32)},
    }
    grad = jax.jit(jax.value_and_grad(loss_fn))
    table = {"embedding": {"name": "adagrad", "kwargs": {"learning_rate": 0.5}}}
    with program.session(
        variables, tables={"embedding": "ids"}, evaluate=evaluate, optimizers=table
    ) as sess:
        while not sess.should_stop():
            batch = sess.next_batch()
            if batch is None:
                continue
            ids = np.asarray(batch["ids"])
            unique, inverse = np.unique(ids, return_inverse=True)
            wanted = np.full(ids.size, unique[0])  # one shape a batch: compiled once
            wanted[: unique.size] = unique
            values = sess.pull(rows={TABLE: wanted})
            if sess.over:
                continue
            params = {
                "embedding": values[TABLE],
                "dense": {
                    "kernel": values["['dense']['kernel']"],
                    "bias": values["['dense']['bias']"],
                },
            }
            local = {"ids": inverse.reshape(ids.shape), "y": batch["y"]}
            loss, grads = grad(params, local)
            sess.push(
                {
                    "['dense']['kernel']": grads["dense"]["kernel"],
                    "['dense']['bias']": grads["dense"]["bias"],
                },
                rows={TABLE: (wanted, np.asarray(grads["embedding"]))},
                loss=loss,
            )
