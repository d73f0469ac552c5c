"""The training configuration: defaults, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxps_runtime import config


def test_an_empty_configuration_gets_every_default() -> None:
    training = config.parse({})
    assert training.model.name == "mlp"
    assert training.dataset.name == "digits"  # the model's default dataset
    assert (training.mode, training.steps, training.batchSize, training.seed) == (
        "async",
        1000,
        32,
        0,
    )
    assert training.optimizer.name == "adagrad"
    assert training.placement.strategy == "greedy"
    assert training.placement.minShardBytes == 256 << 10
    assert training.staleness == 2


def test_a_full_configuration_round_trips_through_json() -> None:
    raw = {
        "model": {"name": "embedding", "kwargs": {"rows": 1000}},
        "dataset": {"name": "sparse", "kwargs": {"idRange": 500}},
        "mode": "boundedStaleness",
        "maxStaleness": 4,
        "steps": 10,
        "batchSize": 8,
        "seed": 3,
        "optimizer": {"name": "sgd", "kwargs": {"learning_rate": 0.1}},
        "placement": {"strategy": "roundRobin", "minShardBytes": 1024},
        "checkpoint": {"dir": "/ckpt", "everySteps": 5, "keep": 2},
    }
    training = config.parse(raw)
    assert config.loads(training.to_json()) == training
    assert training.staleness == 4


def test_yaml_files_are_read(tmp_path: Path) -> None:
    file = tmp_path / "training.yaml"
    file.write_text("mode: sync\nsteps: 5\nreplicasToAggregate: 2\n")
    training = config.load(file)
    assert (training.mode, training.steps, training.replicasToAggregate) == ("sync", 5, 2)


BAD = [
    ({"steps": 0}, "training.steps: got 0; expected an integer >= 1"),
    ({"steps": "10"}, 'training.steps: got "10"; expected an integer >= 1'),
    ({"steps": True}, "training.steps: got true; expected an integer >= 1"),
    ({"batchSize": -1}, "training.batchSize: got -1"),
    ({"mode": "sideways"}, 'training.mode: got "sideways"; expected one of sync, async'),
    (
        {"mode": "async", "replicasToAggregate": 2},
        "training.replicasToAggregate: got 2; expected no value unless mode is sync",
    ),
    (
        {"mode": "sync", "maxStaleness": 1},
        "training.maxStaleness: got 1; expected no value unless mode is boundedStaleness",
    ),
    ({"stepz": 1}, "training.stepz: unknown field; allowed: "),
    (
        {"model": {"name": "resnet"}},
        'training.model.name: got "resnet"; expected one of linear, mlp, embedding',
    ),
    ({"model": {"nme": "mlp"}}, "training.model.nme: unknown field"),
    ({"model": "mlp"}, 'training.model: got "mlp"; expected an object'),
    ({"dataset": {"name": "imagenet"}}, 'training.dataset.name: got "imagenet"'),
    (
        {"optimizer": {"name": "adamw", "kwargs": {"lr": 1}}},
        "training.optimizer.kwargs.lr: optax.adamw has no argument 'lr'",
    ),
    ({"optimizer": {"name": "nope"}}, "training.optimizer.name: 'nope' is not an optax"),
    (
        {"placement": {"strategy": "random"}},
        'training.placement.strategy: got "random"; expected one of greedy, roundRobin',
    ),
    ({"placement": {"minShardBytes": 0}}, "training.placement.minShardBytes: got 0"),
    ({"checkpoint": {"keep": 0}}, "training.checkpoint.keep: got 0"),
    ({"checkpoint": {"everySeconds": "often"}}, "training.checkpoint.everySeconds"),
    ({"logEverySeconds": float("nan")}, "training.logEverySeconds"),
    (
        {"heartbeatSeconds": 5, "workerTimeoutSeconds": 2},
        "training.workerTimeoutSeconds: got 2.0; expected more than heartbeatSeconds (5.0)",
    ),
    ([], "training: got []; expected an object"),
]


@pytest.mark.parametrize(
    ("raw", "message"), BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(BAD)]
)
def test_bad_configurations_name_the_field(raw: object, message: str) -> None:
    with pytest.raises(config.TrainingConfigError) as caught:
        config.parse(raw)
    assert message in str(caught.value)


def test_text_that_is_not_yaml_is_refused() -> None:
    with pytest.raises(config.TrainingConfigError, match="JAXPS_TRAINING: not JSON or YAML"):
        config.loads("{steps: [", path="JAXPS_TRAINING")
