"""A user's own training loop (`training.program`) that goes astray on demand: the tests of
tests/process/test_outcomes.py name one of its functions as the job's program."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxps_runtime.train import program


def _loss(params: Any, batch: Any) -> Any:
    logits = batch["x"] @ params["w"] + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _loop(
    *, stop_after: int | None = None, hang_at: int | None = None, rename: bool = False
) -> None:
    variables = {"w": np.zeros((64, 10), np.float32), "b": np.zeros(10, np.float32)}
    grad = jax.jit(jax.value_and_grad(_loss))
    with program.session(variables) as session:
        batches = 0
        while not session.should_stop():
            batch = session.next_batch()
            if batch is None:
                continue
            batches += 1
            if batches == stop_after:
                break  # leaves the session before training is over
            if batches == hang_at:
                threading.Event().wait()  # stuck in its own code, never asks again
            loss, grads = grad(session.params(), batch)
            if rename:  # a typo: "W" for "w"
                grads = {"W": grads["w"], "b": grads["b"]}
            session.push_tree(grads, loss=jnp.asarray(loss))


def exits() -> None:
    """Calls sys.exit(0) before it opens its session."""
    sys.exit(0)


def leaves_early() -> None:
    _loop(stop_after=3)


def hangs() -> None:
    """Hangs in its own code on worker 0 (the job's chief) at its 5th batch."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    _loop(hang_at=5 if (task["type"], task["index"]) == ("worker", 0) else None)


def vanishes() -> None:
    """Ends its process with os._exit(0) before it opens its session: no exception, no summary,
    exit code 0."""
    os._exit(0)


def misnames() -> None:
    """Pushes the gradient of `w` as `W`: a variable the session does not have."""
    _loop(rename=True)


def declares_nothing() -> None:
    """Opens its session on an empty tree: a sync step waited for gradients of nothing."""
    with program.session({}) as session:
        while not session.should_stop():
            session.next_batch()


def declares_by_task() -> None:
    """Worker i declares `w` with 64 + i rows: worker 1's differ from those the chief (worker
    0) initialised the ps tier with."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    rows = 64 + int(task["index"]) if task["type"] == "worker" else 64
    with program.session({"w": np.zeros((rows, 10), np.float32)}) as session:
        while not session.should_stop():
            if session.next_batch() is not None:
                session.params()
