"""A small GAN, which the built-in loop cannot express: two networks, two losses, trained in
turns, with two optimizers. Even global steps update the discriminator, odd ones the generator;
each step pushes the gradients of one network only. The generator is updated by the job's
`training.optimizer`, the discriminator by an Adam of its own with half its learning rate
(`optimizers=`; as `tf.train.AdamOptimizer` twice in TF1), each with its own state on the ps.
The real data is the loop's own: samples of N(4, 1.25); the generator learns to turn N(0, 1)
noise into it.

    PYTHONPATH=examples/programs jaxps local examples/gan.yaml

`evaluate` reports how far the generated distribution is from the real one (`mean_error`,
`std_error`, lower is better): the job's summary shows them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxps_runtime.train import program

REAL_MEAN, REAL_STD = 4.0, 1.25
NOISE, HIDDEN, BATCH = 4, 16, 64


def _layer(key: jax.Array, fan_in: int, fan_out: int) -> dict[str, np.ndarray]:
    kernel = jax.nn.initializers.glorot_uniform()(key, (fan_in, fan_out), jnp.float32)
    return {"kernel": np.asarray(kernel), "bias": np.zeros(fan_out, np.float32)}


def build(key: jax.Array) -> dict[str, Any]:
    k = jax.random.split(key, 4)
    return {
        "generator": {"l0": _layer(k[0], NOISE, HIDDEN), "l1": _layer(k[1], HIDDEN, 1)},
        "discriminator": {"l0": _layer(k[2], 1, HIDDEN), "l1": _layer(k[3], HIDDEN, 1)},
    }


def _mlp(net: Any, x: jax.Array) -> jax.Array:
    hidden = jax.nn.leaky_relu(x @ net["l0"]["kernel"] + net["l0"]["bias"])
    out: jax.Array = hidden @ net["l1"]["kernel"] + net["l1"]["bias"]
    return out


def _bce(logits: jax.Array, label: float) -> jax.Array:
    return jnp.mean(jnp.maximum(logits, 0) - logits * label + jnp.log1p(jnp.exp(-jnp.abs(logits))))


def d_loss(disc: Any, gen: Any, real: jax.Array, noise: jax.Array) -> jax.Array:
    fake = _mlp(gen, noise)
    return _bce(_mlp(disc, real), 1.0) + _bce(_mlp(disc, fake), 0.0)


def g_loss(gen: Any, disc: Any, noise: jax.Array) -> jax.Array:
    return _bce(_mlp(disc, _mlp(gen, noise)), 1.0)


def evaluate(params: Any, _test: Any) -> dict[str, jax.Array]:
    fake = _mlp(params["generator"], jax.random.normal(jax.random.PRNGKey(7), (4096, NOISE)))
    return {
        "mean_error": jnp.abs(jnp.mean(fake) - REAL_MEAN),
        "std_error": jnp.abs(jnp.std(fake) - REAL_STD),
    }


def main() -> None:
    training = program.training()
    d_step = jax.jit(jax.value_and_grad(d_loss))
    g_step = jax.jit(jax.value_and_grad(g_loss))
    variables = build(jax.random.PRNGKey(training.seed))
    discriminator = {"name": "adam", "kwargs": {"learning_rate": 0.001, "b1": 0.5}}
    with program.session(
        variables, evaluate=evaluate, optimizers={"discriminator": discriminator}
    ) as sess:
        rng = np.random.default_rng()  # each worker its own samples
        while not sess.should_stop():
            params = sess.params()
            if sess.over:
                continue
            noise = rng.standard_normal((BATCH, NOISE)).astype(np.float32)
            if sess.global_step % 2 == 0:  # the discriminator's turn
                real = rng.normal(REAL_MEAN, REAL_STD, (BATCH, 1)).astype(np.float32)
                loss, grads = d_step(params["discriminator"], params["generator"], real, noise)
                sess.push_tree({"discriminator": grads}, loss=loss)
            else:  # the generator's
                loss, grads = g_step(params["generator"], params["discriminator"], noise)
                sess.push_tree({"generator": grads}, loss=loss)
