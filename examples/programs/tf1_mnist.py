"""The distributed TensorFlow guide's trainer ("Putting it all together": between-graph
replication), ported line by line to jaxps: each TF1 line is in the comment above what replaces
it. The model is the built-in `mlp` (one hidden layer of 64, relu), so the two can be compared.

    PYTHONPATH=examples/programs jaxps local examples/tf1-mnist.yaml
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxps_runtime.train import program

HIDDEN = 64
CLASSES = 10


def build_model(key: jax.Array, *, inputs: int) -> dict[str, Any]:
    """The variables, as Keras (and the built-in mlp) initialise them."""
    k1, k2 = jax.random.split(key)
    glorot = jax.nn.initializers.glorot_uniform()
    return {
        "hidden_0": {
            "kernel": np.asarray(glorot(k1, (inputs, HIDDEN), jnp.float32)),
            "bias": np.zeros(HIDDEN, np.float32),
        },
        "output": {
            "kernel": np.asarray(glorot(k2, (HIDDEN, CLASSES), jnp.float32)),
            "bias": np.zeros(CLASSES, np.float32),
        },
    }


def logits(params: Any, x: jax.Array) -> jax.Array:
    hidden = jax.nn.relu(x @ params["hidden_0"]["kernel"] + params["hidden_0"]["bias"])
    out: jax.Array = hidden @ params["output"]["kernel"] + params["output"]["bias"]
    return out


def loss_fn(params: Any, batch: Any) -> jax.Array:
    losses = optax.softmax_cross_entropy_with_integer_labels(logits(params, batch["x"]), batch["y"])
    return losses.mean()


def accuracy(params: Any, batch: Any) -> dict[str, jax.Array]:
    predicted = jnp.argmax(logits(params, batch["x"]), axis=-1)
    return {"accuracy": jnp.mean(predicted == batch["y"]), "loss": loss_fn(params, batch)}


def main() -> None:
    # cluster = tf.train.ClusterSpec({"ps": ps_hosts, "worker": worker_hosts})
    # server = tf.train.Server(cluster, job_name=FLAGS.job_name, task_index=FLAGS.task_index)
    #     (jaxps: every task reads TF_CONFIG, which the operator or `jaxps local` sets)
    # if FLAGS.job_name == "ps":
    #     server.join()
    #     (jaxps: the ps tasks run jaxps's ps, no user code; this runs on the chief and workers)
    # with tf.device(tf.train.replica_device_setter(cluster=cluster)):
    #     (jaxps: training.placement puts each variable on a ps, round-robin by default)
    #   # Build model...
    training = program.training()
    inputs = program.dataset().test()["x"].shape[1]
    variables = build_model(jax.random.PRNGKey(training.seed), inputs=inputs)
    #   loss = ...
    grad = jax.jit(jax.value_and_grad(loss_fn))
    #   global_step = tf.contrib.framework.get_or_create_global_step()
    #     (jaxps: the ps tier counts the global step: sess.global_step)
    #   train_op = tf.train.AdagradOptimizer(0.01).minimize(loss, global_step=global_step)
    #     (jaxps: training.optimizer, applied on each ps; the worker pushes the gradients)
    # hooks=[tf.train.StopAtStepHook(last_step=1000000)]
    #     (jaxps: training.steps; and a LoggingTensorHook's counterpart)
    hooks = [program.LoggingHook(every_steps=100)]
    # with tf.train.MonitoredTrainingSession(master=server.target,
    #                                        is_chief=(FLAGS.task_index == 0),
    #                                        checkpoint_dir="/tmp/train_logs",
    #                                        hooks=hooks) as mon_sess:
    #     (jaxps: the chief is the chief task, or worker 0; checkpoints: training.checkpoint)
    with program.session(variables, evaluate=accuracy, hooks=hooks) as mon_sess:
        #   while not mon_sess.should_stop():
        while not mon_sess.should_stop():
            #   mon_sess.run(train_op)   (its feed: mnist.train.next_batch(...))
            batch = mon_sess.next_batch()
            if batch is None:  # no batch now (an epoch's end, a recovery): ask again
                continue
            loss, grads = grad(mon_sess.params(), batch)
            mon_sess.push_tree(grads, loss=loss)
