"""One task of TensorFlow's own parameter-server training, for bench/vs_tensorflow.py.

Runs in the TensorFlow virtual environment (`make bench-tf` builds it), never in jaxps's. It is
TF1-style between-graph replication exactly as TensorFlow's distributed guide shows it
(`tf.compat.v1`): a `tf.train.Server` per task; ps tasks `join()`; each worker builds the whole
graph under `replica_device_setter`, trains with `AdagradOptimizer` (wrapped in
`SyncReplicasOptimizer` in sync mode) inside a `MonitoredTrainingSession` with a `StopAtStepHook`,
and feeds its batches with `feed_dict`. Worker 0 is the chief; it evaluates the final parameters.

    python bench/tf/task.py --cluster JSON --job worker --index 0 --case JSON --data D --out R

The data file holds the very batches jaxps reads (`x`/`ids`, `y`, `test_*`, and `order`: per
worker, per local step, the rows of its batch) and the parameters jaxps starts from
(`init/<variable path>`), so both systems train from the same values on the same examples.
A worker writes its span to `--out` as jaxps's workers report theirs: the wall time and global
step at the end of its first (warm-up) step and of its last step, and the bytes of the model's
variables on each ps; the chief adds its test accuracy.

Variables are split over the ps tasks by jaxps's rule (`partitioner`: above 256 KiB, into up to
one part per ps), so both systems hold and move the same bytes per ps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1


def partitioner(case: dict[str, Any], shape: list[int]) -> Any:
    """jaxps's placement rule (jaxps_runtime.client.placement): a variable of more than
    `min_shard_bytes` is split along axis 0 into min(ps, rows, bytes // min_shard_bytes) parts,
    like `np.array_split`; a smaller one is a plain variable. TensorFlow's
    `min_max_variable_partitioner` rounds that quotient up instead of down; the sizes here split
    the same either way. `replica_device_setter` places the parts round-robin, so the parts of
    a variable, created one after the other, land on different ps as in jaxps."""
    nbytes = int(np.prod(shape)) * 4  # float32
    if nbytes <= case["min_shard_bytes"]:
        return None
    parts = min(case["ps"], shape[0], nbytes // case["min_shard_bytes"])
    return v1.fixed_size_partitioner(parts) if parts > 1 else None


class Initial:
    """The values jaxps starts from (`init/<variable path>` in the data file), fed to the
    chief's variable initialisers through placeholders (`Scaffold(init_feed_dict=...)`), so
    that both systems start from the very same parameters and differ only in how they train:
    test accuracies compared then are not two draws of a random initialisation. Only the
    chief initialises, so only the chief reads the values (`data` None on the others)."""

    def __init__(self, data: Any | None) -> None:
        self.data = data
        self.feed: dict[Any, np.ndarray] = {}

    def variable(self, case: dict[str, Any], name: str, shape: list[int]) -> Any:
        path = f"{v1.get_variable_scope().name}/{name}".lstrip("/")
        # On the worker that feeds it: each part's initialiser takes its own rows.
        with v1.device(None):
            placeholder = v1.placeholder(tf.float32, shape, name=f"{name}_initial")
        if self.data is not None:
            value = self.data[f"init/{path}"]
            if list(value.shape) != shape:
                raise ValueError(f"{path}: jaxps starts it at shape {value.shape}, not {shape}")
            self.feed[placeholder] = value

        def initializer(part: list[int], dtype: Any = None, partition_info: Any = None) -> Any:
            if partition_info is None:
                return placeholder
            return tf.slice(placeholder, partition_info.var_offset, part)

        return v1.get_variable(
            name, shape, initializer=initializer, partitioner=partitioner(case, shape)
        )


def mlp(case: dict[str, Any], inputs: dict[str, Any], initial: Initial) -> tuple[Any, Any]:
    """jaxps's `mlp`: relu hidden layers, then logits."""
    widths = [64, *case["hidden"], 10]
    x = inputs["x"]
    names = [f"hidden_{i}" for i in range(len(case["hidden"]))] + ["output"]
    for i, name in enumerate(names):
        with v1.variable_scope(name):
            kernel = initial.variable(case, "kernel", widths[i : i + 2])
            x = x @ kernel + initial.variable(case, "bias", [widths[i + 1]])
        if name != "output":
            x = tf.nn.relu(x)
    labels = inputs["y"]
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=x))
    accuracy = tf.reduce_mean(
        tf.cast(tf.equal(tf.argmax(x, -1, output_type=tf.int32), labels), tf.float32)
    )
    return loss, accuracy


def embedding(case: dict[str, Any], inputs: dict[str, Any], initial: Initial) -> tuple[Any, Any]:
    """jaxps's `embedding`: the mean embedding of an example's ids into one logit. The table is
    partitioned over the ps tasks by rows as jaxps splits it (`partitioner`) and read by
    `embedding_lookup`, so a step moves only the rows it uses (IndexedSlices gradients); id i
    reads row i as in jaxps ("div": the parts hold consecutive ids; TF1's default, "mod", would
    read id i from part i % parts)."""
    table = initial.variable(case, "embedding", [case["rows"], case["dim"]])
    rows = v1.nn.embedding_lookup(table, inputs["ids"], partition_strategy="div")
    pooled = tf.reduce_mean(rows, axis=1)
    with v1.variable_scope("dense"):
        kernel = initial.variable(case, "kernel", [case["dim"], 1])
        logits = (pooled @ kernel + initial.variable(case, "bias", [1]))[:, 0]
    labels = inputs["y"]
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(logits > 0, labels > 0.5), tf.float32))
    return loss, accuracy


class Evaluate(v1.train.SessionRunHook):
    """The chief's test accuracy on the final parameters, as the session ends."""

    def __init__(self, accuracy: Any, feed: dict[Any, np.ndarray]) -> None:
        self.accuracy = accuracy
        self.feed = feed
        self.value: float | None = None

    def end(self, session: Any) -> None:
        self.value = float(session.run(self.accuracy, feed_dict=self.feed))


def barrier(directory: Path, index: int, workers: int, *, timeout: float = 600.0) -> None:
    """Waits until every worker has its session, so the workers train side by side.

    Without it an async chief may train alone for a while: a non-chief that finds the chief's
    variables not initialised yet sleeps 30 s before it looks again (TensorFlow's
    SessionManager), which the driver's `job_seconds` still shows.
    """
    (directory / f"ready-{index}").touch()
    deadline = time.monotonic() + timeout
    while not all((directory / f"ready-{i}").exists() for i in range(workers)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {index}: the other workers had no session in {timeout} s")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="cluster spec as JSON")
    parser.add_argument("--job", choices=["ps", "worker"], required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--case", required=True, help="the workload as JSON")
    parser.add_argument("--data", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    spec = json.loads(args.cluster)
    case = json.loads(args.case)
    v1.disable_eager_execution()
    tf.get_logger().setLevel("INFO")
    cluster = tf.train.ClusterSpec(spec)
    # The guide's device filters: a worker talks to the ps tasks and itself, not to its peers.
    config = v1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{args.index}"])
    server = v1.train.Server(cluster, job_name=args.job, task_index=args.index, config=config)
    if args.job == "ps":
        server.join()  # TensorFlow's ps never returns: the driver stops it (research pitfall 1)
        return

    data = np.load(args.data)
    is_chief = args.index == 0
    workers = len(spec["worker"])
    device = v1.train.replica_device_setter(
        worker_device=f"/job:worker/task:{args.index}", cluster=cluster
    )
    with v1.device(device):
        global_step = v1.train.get_or_create_global_step()
        feature = "ids" if case["model"] == "embedding" else "x"
        inputs = {
            feature: v1.placeholder(
                tf.as_dtype(data[feature].dtype), [None, *data[feature].shape[1:]]
            ),
            "y": v1.placeholder(tf.as_dtype(data["y"].dtype), [None]),
        }
        initial = Initial(data if is_chief else None)
        loss, accuracy = (embedding if case["model"] == "embedding" else mlp)(case, inputs, initial)
        optimizer = v1.train.AdagradOptimizer(
            case["learning_rate"], initial_accumulator_value=case["initial_accumulator_value"]
        )
        hooks: list[Any] = [v1.train.StopAtStepHook(last_step=case["steps"])]
        if case["mode"] == "sync":
            optimizer = v1.train.SyncReplicasOptimizer(
                optimizer, replicas_to_aggregate=workers, total_num_replicas=workers
            )
            hooks.append(optimizer.make_session_run_hook(is_chief))
        train_op = optimizer.minimize(loss, global_step=global_step)
    ps_bytes = [0] * len(spec["ps"])  # the model's variables on each ps, as jaxps places its own
    for variable in v1.trainable_variables():
        task = v1.DeviceSpec.from_string(variable.device).task
        ps_bytes[task] += variable.shape.num_elements() * variable.dtype.base_dtype.size

    evaluate = Evaluate(
        accuracy, {inputs[feature]: data[f"test_{feature}"], inputs["y"]: data["test_y"]}
    )
    order = data["order"][args.index]
    local = 0
    span: list[float] = []
    with v1.train.MonitoredTrainingSession(
        master=server.target,
        is_chief=is_chief,
        scaffold=v1.train.Scaffold(init_feed_dict=initial.feed),
        hooks=hooks,
        chief_only_hooks=[evaluate],
        config=config,
        save_checkpoint_secs=None,
        save_summaries_steps=None,
        save_summaries_secs=None,
        log_step_count_steps=None,
        # In sync mode the chief's token queue runner is left blocked once the other worker has
        # gone; closing would wait the default 120 s for it before giving up (job_seconds only).
        stop_grace_period_secs=5,
    ) as session:
        barrier(args.out.parent, args.index, workers)
        while not session.should_stop():
            rows = order[local % len(order)]
            feed = {inputs[feature]: data[feature][rows], inputs["y"]: data["y"][rows]}
            _, step = session.run([train_op, global_step], feed_dict=feed)
            local += 1
            now = time.time()
            if local == 1:  # the first step builds and places everything: leave it out
                span = [now, float(step), now, float(step)]
            span[2:] = [now, float(step)]
    result = {"steps": local, "span": span, "accuracy": evaluate.value, "ps_bytes": ps_bytes}
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
