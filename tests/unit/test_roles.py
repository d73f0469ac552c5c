"""A training task's start: an invalid training configuration exits 78, its problems in the
termination log, one a line."""

from __future__ import annotations

import json
from pathlib import Path

from jaxps_runtime import roles
from jaxps_runtime.config import cluster
from jaxps_runtime.config import training as config
from jaxps_runtime.process import stopping

WORKER_1 = {
    "cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]},
    "task": {"type": "worker", "index": 1},
}


def _start(training_env: str | None) -> int:
    spec = cluster.from_env({"TF_CONFIG": json.dumps(WORKER_1)})
    assert spec is not None
    return roles.run(
        spec=spec,
        job_id="job",
        bind=None,
        training_file=None,
        training_env=training_env,
        metrics_port=0,
        stop=stopping.Stop(),
    )


def test_a_worker_without_jaxps_training_exits_78_naming_the_variable(
    termination_log: Path,
) -> None:
    assert _start(None) == config.EXIT_INVALID_TRAINING
    assert termination_log.read_text().startswith("JAXPS_TRAINING: not set; a worker")


def test_every_problem_of_the_configuration_is_one_line_of_the_termination_log(
    termination_log: Path,
) -> None:
    training = {"model": {"name": "resnet"}, "optimizer": {"name": "sgdd"}}
    assert _start(json.dumps(training)) == config.EXIT_INVALID_TRAINING
    lines = termination_log.read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "JAXPS_TRAINING.model.name",
        "JAXPS_TRAINING.optimizer.name",
    ]


def test_what_only_jax_finds_is_reported_at_start_too(termination_log: Path) -> None:
    training = {
        "model": {"name": "q", "module": "no_such_pkg.models:make"},
        "dataset": {"module": "no_such_pkg.data:make"},
    }
    assert _start(json.dumps(training)) == config.EXIT_INVALID_TRAINING
    lines = termination_log.read_text().splitlines()
    assert lines[0].startswith("model.module: 'no_such_pkg.models:make': cannot import")
    assert lines[1].startswith("dataset.module: 'no_such_pkg.data:make': cannot import")
    assert len(lines) == 2


def test_a_model_with_no_parameters_or_a_parameter_that_is_no_float_is_refused() -> None:
    """An NNX module without an nnx.Param trained nothing and Succeeded at chance; an integer
    nnx.Param failed at the first step inside jax.grad, naming jaxps' own frame."""
    import jax.numpy as jnp

    assert roles._parameter_problems({}, model="m") == [
        "model 'm' has no parameters: there is nothing to train"
    ]
    shapes = {
        "lin": {"w": jnp.zeros((64, 10), jnp.float32)},
        "count": jnp.zeros((2,), jnp.int32),
    }
    assert roles._parameter_problems(shapes, model="m") == [
        "model 'm': parameter ['count'] is int32[2]; every parameter must be a float (jax.grad "
        "differentiates floats only)"
    ]
    assert roles._parameter_problems({"w": jnp.zeros((0,), jnp.bfloat16)}, model="m") == []
