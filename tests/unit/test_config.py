"""The training configuration: defaults, and errors that name the field."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jaxps_runtime.config import catalog
from jaxps_runtime.config import training as config
from tests.unit import imports


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
    (
        {"optimizer": {"name": "sgdd"}},
        'training.optimizer.name: got "sgdd"; expected one of adabelief, adadelta, ',
    ),
    (
        {"optimizer": {"name": "sgd", "kwargs": {}}},
        "training.optimizer.kwargs.learning_rate: missing; optax.sgd requires learning_rate",
    ),
    ({"optimizer": {"name": "sgd", "extra": 1}}, "training.optimizer: unknown key 'extra'"),
    ({"optimizer": {"name": "adam", "kwargs": []}}, "training.optimizer.kwargs: expected an obj"),
    ({"optimizer": "sgd"}, "training.optimizer: expected an object {name, kwargs}"),
    (
        {"optimizer": {"name": "adam", "kwargs": {"learning_rate": "0.01"}}},
        'training.optimizer.kwargs.learning_rate: got "0.01"; expected a finite number > 0',
    ),
    (
        {"optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.1, "b2": 1}}},
        "training.optimizer.kwargs.b2: got 1; expected a finite number >= 0 and < 1",
    ),
    (
        {"onDivergence": "rollback"},
        'training.onDivergence: got "rollback"; expected "fail" unless training.checkpoint.dir '
        "is set: a rollback restores the last checkpoint",
    ),
    (
        {"model": {"name": "embedding", "kwargs": {"rows": 1000}}},
        "training.model.kwargs.rows: got 1000; expected at least "
        "training.dataset.kwargs.idRange (150000): the dataset's ids run up to 149999",
    ),
    (
        {
            "model": {"name": "embedding", "kwargs": {"idsPerExample": 3}},
            "dataset": {"name": "sparse", "kwargs": {"idsPerExample": 5}},
        },
        "training.model.kwargs.idsPerExample: got 3; expected "
        "training.dataset.kwargs.idsPerExample (5), the ids of each example",
    ),
    (
        {"model": {"name": "embedding"}, "dataset": {"name": "digits"}},
        'training.dataset.name: got "digits"; expected sparse or your files for model '
        "embedding, which reads batch key 'ids'",
    ),
    (
        {"model": {"name": "mlp"}, "dataset": {"name": "sparse"}},
        'training.dataset.name: got "sparse"; expected synthetic, digits, idx or your files for '
        "model mlp, which reads batch key 'x'",
    ),
    (
        {"model": {"name": "linear"}, "dataset": {"name": "digits"}},
        "training.model.kwargs.features: got 16; expected 64, the width of x in digits",
    ),
    (
        {"model": {"name": "linear"}, "dataset": {"kwargs": {"features": 8}}},
        "training.model.kwargs.features: got 16; expected 8, the width of x in synthetic "
        "(training.dataset.kwargs.features)",
    ),
    (
        {"model": {"name": "mlp", "kwargs": {"inputs": 32}}},
        "training.model.kwargs.inputs: got 32; expected 64, the width of x in digits",
    ),
    (
        {"model": {"name": "mlp", "kwargs": {"classes": 2}}},
        "training.model.kwargs.classes: got 2; expected at least 10: digits' labels are 0..9",
    ),
    (
        {"model": {"name": "mlp"}, "dataset": {"name": "synthetic"}},
        'training.dataset.name: got "synthetic"; expected a dataset of class labels for model '
        "mlp (digits, idx or your files): synthetic's y is a real number",
    ),
    (
        {"model": {"name": "mlp", "kwargs": {"hiden": [8]}}},
        "training.model.kwargs.hiden: unknown argument 'hiden'; allowed: hidden, inputs, classes",
    ),
    (
        {"model": {"name": "mlp", "kwargs": {"hidden": [64, 0]}}},
        "training.model.kwargs.hidden[1]: expected an integer >= 1, got 0",
    ),
    (
        {"model": {"name": "embedding", "kwargs": {"rows": True}}},
        "training.model.kwargs.rows: expected an integer >= 1, got True",
    ),
    (
        {"dataset": {"name": "digits", "kwargs": {"testFraction": 1.5}}},
        "training.dataset.kwargs.testFraction: expected a number strictly between 0 and 1",
    ),
    (
        {"model": {"name": "linear"}, "dataset": {"kwargs": {"testFraction": 0.1}}},
        "training.dataset.kwargs.testFraction: unknown argument 'testFraction'; allowed: features",
    ),
    (
        {"model": {"name": "mine", "module": "mymodels"}},
        "training.model.module: 'mymodels' is malformed; expected 'package.module:factory'",
    ),
    (
        {"program": "train_loop"},
        "training.program: 'train_loop' is malformed; expected 'package.module:factory'",
    ),
    ({"program": 7}, "training.program: got 7; expected a non-empty string"),
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
    (
        {"tensorboard": {}},
        "training.tensorboard.dir: missing; expected a non-empty string, the directory of the "
        "event files",
    ),
    ({"tensorboard": {"dir": ""}}, 'training.tensorboard.dir: got ""; expected a non-empty str'),
    (
        {"tensorboard": {"dir": "/tb", "flushSeconds": 0}},
        "training.tensorboard.flushSeconds: got 0; expected an integer >= 1",
    ),
    (
        {"tensorboard": {"dir": "/tb", "flushSeconds": 2.5}},
        "training.tensorboard.flushSeconds: got 2.5; expected an integer >= 1",
    ),
    (
        {"tensorboard": {"directory": "/tb"}},
        "training.tensorboard.directory: unknown field; allowed: dir, flushSeconds",
    ),
    ({"tensorboard": "/tb"}, 'training.tensorboard: got "/tb"; expected an object'),
]


@pytest.mark.parametrize(
    ("raw", "message"), BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(BAD)]
)
def test_bad_configurations_name_the_field(raw: object, message: str) -> None:
    with pytest.raises(config.TrainingConfigError) as caught:
        config.parse(raw)
    assert message in str(caught.value)


def test_a_misspelt_model_and_a_misspelt_optimizer_are_both_named() -> None:
    raw = {"model": {"name": "resnet"}, "optimizer": {"name": "sgdd"}}
    found = config.problems(raw)
    allowed = ", ".join(sorted(catalog.optimizers()))
    assert found == [
        'training.model.name: got "resnet"; expected one of linear, mlp, embedding '
        "(or set model.module)",
        f'training.optimizer.name: got "sgdd"; expected one of {allowed}',
    ]
    with pytest.raises(config.TrainingConfigError) as caught:
        config.parse(raw)
    assert str(caught.value) == found[0]  # parse names the first
    assert caught.value.problems == tuple(found)


def test_problems_lists_every_independent_section() -> None:
    raw = {
        "model": {"name": "mlp", "kwargs": {"hidden": "64"}},
        "dataset": {"name": "imagenet"},
        "mode": "async",
        "replicasToAggregate": 2,
        "optimizer": {"name": "adam", "kwargs": {"lr": 0.1}},
        "steps": 0,
        "heartbeatSeconds": 5,
        "workerTimeoutSeconds": 2,
        "stepz": 1,
    }
    fields = [problem.split(":")[0] for problem in config.problems(raw)]
    assert fields == [
        "training.model.kwargs.hidden",
        "training.dataset.name",
        "training.replicasToAggregate",
        "training.optimizer.kwargs.lr",
        "training.optimizer.kwargs.learning_rate",  # missing: lr is not its name
        "training.steps",
        "training.stepz",
        "training.workerTimeoutSeconds",
    ]


def test_a_refused_value_is_not_compared_with_another_field() -> None:
    raw = {"heartbeatSeconds": "often", "workerTimeoutSeconds": 0.1}
    assert config.problems(raw) == [
        'training.heartbeatSeconds: got "often"; expected a number >= 0.05',
        "training.workerTimeoutSeconds: got 0.1; expected a number >= 0.5",
    ]


def test_a_valid_configuration_has_no_problems() -> None:
    assert config.problems({"model": {"name": "linear"}, "optimizer": {"name": "adadelta"}}) == []


def test_a_user_model_is_checked_for_its_form_only_not_imported() -> None:
    raw = {"model": {"name": "mine", "module": "no_such_pkg.models:make", "kwargs": {"x": 1}}}
    training = config.parse(raw)
    assert training.model.module == "no_such_pkg.models:make"
    assert training.dataset.name == "synthetic"  # a user model's default dataset
    assert "no_such_pkg" not in sys.modules


def test_a_program_is_checked_for_its_form_only_and_the_model_is_not_fitted_to_the_data() -> None:
    raw = {"program": "no_such_pkg.loops:main", "dataset": {"name": "synthetic"}}
    training = config.parse(raw)  # the default model (mlp) would not fit synthetic's y
    assert training.program == "no_such_pkg.loops:main"
    assert "no_such_pkg" not in sys.modules


def test_optimizer_config_round_trips_through_json() -> None:
    optimizer = config.OptimizerConfig.from_dict(
        {"name": "adagrad", "kwargs": {"learning_rate": 0.1}}
    )
    assert config.OptimizerConfig.from_json(optimizer.to_json()) == optimizer


def test_the_configuration_is_parsed_without_jax_optax_or_numpy() -> None:
    """What the operator's image (no JAX, optax or numpy) does with a whole manifest."""
    raw = {
        "model": {"name": "embedding", "kwargs": {"rows": 1000, "dim": 8}},
        "dataset": {"name": "sparse", "kwargs": {"idRange": 500}},
        "mode": "sync",
        "replicasToAggregate": 2,
        "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01, "b1": 0.8}},
        "placement": {"strategy": "roundRobin", "minShardBytes": 1024},
        "checkpoint": {"dir": "/ckpt", "everySeconds": 30, "keep": 2},
    }
    code = (
        "import json\n"
        "from jaxps_runtime.config import training as config\n"
        f"config.parse(json.loads({json.dumps(json.dumps(raw))}))\n"
        "assert config.problems({'model': {'name': 'resnet'}})\n"
    )
    assert imports.loaded_by(code, ("jax", "optax", "numpy")) == []


def test_text_that_is_not_yaml_is_refused() -> None:
    with pytest.raises(config.TrainingConfigError, match="JAXPS_TRAINING: not JSON or YAML"):
        config.loads("{steps: [", path="JAXPS_TRAINING")


def test_tensorboard_is_off_unless_given_and_its_flush_defaults_to_5_seconds() -> None:
    assert config.parse({}).tensorboard is None
    assert config.parse({"tensorboard": None}).tensorboard is None
    training = config.parse({"tensorboard": {"dir": "/tb"}})
    assert training.tensorboard == config.TensorBoardConfig(dir="/tb", flushSeconds=5)
    assert config.loads(training.to_json()) == training
    assert config.loads(config.parse({}).to_json()).tensorboard is None


def test_a_bad_tensorboard_field_is_listed_with_the_other_problems() -> None:
    found = config.problems({"steps": 0, "tensorboard": {"dir": "/tb", "flushSeconds": "5"}})
    assert found == [
        "training.steps: got 0; expected an integer >= 1",
        'training.tensorboard.flushSeconds: got "5"; expected an integer >= 1',
    ]


def test_every_bad_optimizer_argument_is_listed_with_the_other_problems() -> None:
    raw = {
        "optimizer": {"name": "adam", "kwargs": {"learning_rate": "0.01", "nesterov": 1}},
        "steps": 0,
    }
    assert [problem.split(":")[0] for problem in config.problems(raw)] == [
        "training.optimizer.kwargs.learning_rate",
        "training.optimizer.kwargs.nesterov",
        "training.steps",
    ]


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            {"model": {"name": "embedding", "kwargs": {"rows": 10}}, "dataset": {"name": "nope"}},
            id="dataset-refused",
        ),
        pytest.param(
            {
                "model": {"name": "embedding", "kwargs": {"rows": "10"}},
                "dataset": {"name": "sparse"},
            },
            id="model-refused",
        ),
        pytest.param(
            {"onDivergence": "rollback", "checkpoint": {"dir": "/c", "keep": 0}},
            id="checkpoint-refused",
        ),
    ],
)
def test_a_refused_section_is_not_compared_with_another(raw: dict[str, object]) -> None:
    assert len(config.problems(raw)) == 1


@pytest.mark.parametrize(
    ("raw", "workers", "ps", "expected"),
    [
        pytest.param(
            {"mode": "sync", "replicasToAggregate": 5},
            2,
            1,
            [
                "training.replicasToAggregate: got 5; expected at most the number of workers (2, "
                "spec.replicaSpecs.worker.replicas): a sync step waits for that many workers' "
                "gradients"
            ],
            id="aggregating-more-workers-than-there-are",
        ),
        pytest.param(
            {},
            2,
            0,
            [
                "spec.replicaSpecs.ps.replicas: got 0; expected an integer >= 1 while there are "
                "workers: the workers keep their parameters on the ps tasks"
            ],
            id="no-ps",
        ),
        pytest.param(
            {"model": {"name": "linear"}, "dataset": {"kwargs": {"examples": 3}}},
            4,
            1,
            [
                "training.dataset.kwargs.examples: got 3; expected at least the number of workers "
                "(4, spec.replicaSpecs.worker.replicas): each worker trains on its own share"
            ],
            id="fewer-examples-than-workers",
        ),
        pytest.param({"mode": "sync", "replicasToAggregate": 2}, 2, 1, [], id="aggregating-all"),
        pytest.param({"mode": "sync"}, 1, 1, [], id="aggregating-every-live-worker"),
    ],
)
def test_rules_between_the_training_and_the_tasks(
    raw: dict[str, object], workers: int, ps: int, expected: list[str]
) -> None:
    tasks = config.Replicas(workers=workers, ps=ps)
    assert config.problems(raw, replicas=tasks) == expected
    assert config.problems(raw) == []  # without the tasks, nothing to compare with
    training = config.parse(raw)
    assert config.replica_problems(training, tasks, path="training") == expected


def test_a_task_names_its_tf_config_where_a_manifest_names_its_replica_specs() -> None:
    tasks = config.Replicas(
        workers=1, ps=0, workers_field="TF_CONFIG.cluster.worker", ps_field="TF_CONFIG.cluster.ps"
    )
    training = config.parse({"mode": "sync", "replicasToAggregate": 2})
    assert [p.split(";")[0] for p in config.replica_problems(training, tasks, path="JAXPS")] == [
        "TF_CONFIG.cluster.ps: got 0",
        "JAXPS.replicasToAggregate: got 2",
    ]


@pytest.mark.parametrize("rate", [5e-05, 1e-08, 1e30, 3.5e-07])
def test_a_float_json_writes_with_an_exponent_is_a_number(rate: float) -> None:
    """`json.dumps` writes 5e-05 (no dot), which YAML 1.1 (PyYAML) reads as a string: the
    operator and `jaxps local` give each task its training as JSON."""
    raw = {"optimizer": {"name": "adam", "kwargs": {"learning_rate": rate, "eps": 1e-08}}}
    training = config.loads(json.dumps(raw), path="JAXPS_TRAINING")
    assert training.optimizer.kwargs == {"learning_rate": rate, "eps": 1e-08}


@pytest.mark.parametrize("written", ["5e-05", "5E-5", "5.0e-5", "5.e-5", ".5e-4", "+5e-05"])
def test_a_yaml_number_with_an_exponent_is_a_float_as_kubernetes_reads_it(written: str) -> None:
    text = f"optimizer: {{name: adam, kwargs: {{learning_rate: {written}}}}}\n"
    assert config.loads(text).optimizer.kwargs == {"learning_rate": 5e-05}
