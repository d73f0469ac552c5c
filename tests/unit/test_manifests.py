"""The TrainingJob schema: every example is valid; a catalogue of invalid manifests is refused,
each with a message naming its field, the value and what is allowed."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from jaxps_operator import cli, schema

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
GOOD: dict[str, Any] = {
    "apiVersion": "jaxps.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "mnist"},
    "spec": {
        "replicaSpecs": {"ps": {"replicas": 2}, "worker": {"replicas": 2}},
        "training": {"model": {"name": "mlp"}, "steps": 100},
    },
}


def change(path: str, value: Any, *, base: dict[str, Any] = GOOD) -> dict[str, Any]:
    """`base` (GOOD) with the value at a dotted path replaced (or deleted, for the DELETE
    marker)."""
    manifest = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = manifest
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return manifest


DELETE = object()
LONG = "a" * 56  # + "-worker-0" = 65 characters
CATALOGUE: list[tuple[str, dict[str, Any] | Any, str]] = [
    ("wrong-api-version", change("apiVersion", "jaxps.dev/v1"), "apiVersion: Unsupported value"),
    ("wrong-kind", change("kind", "TFJob"), 'kind: Unsupported value: "TFJob"'),
    ("no-name", change("metadata", {}), "metadata.name: Required value"),
    ("upper-case-name", change("metadata.name", "MNIST"), "DNS-1035 label"),
    (
        "name-too-long-for-pods",
        change("metadata.name", LONG),
        "<name>-worker-<index> must fit in 63",
    ),
    ("name-too-long-for-ps", change("metadata.name", "p" * 60), "<name>-ps-<index> must fit in 63"),
    ("no-spec", change("spec", DELETE), "spec: Required value"),
    ("no-replica-specs", change("spec.replicaSpecs", DELETE), "spec.replicaSpecs: Required value"),
    ("no-training", change("spec.training", DELETE), "spec.training: Required value"),
    (
        "no-worker",
        change("spec.replicaSpecs.worker", DELETE),
        "spec.replicaSpecs.worker: Required value",
    ),
    ("zero-workers", change("spec.replicaSpecs.worker.replicas", 0), "at least one worker"),
    ("two-chiefs", change("spec.replicaSpecs.chief", {"replicas": 2}), "at most one chief"),
    (
        "two-evaluators",
        change("spec.replicaSpecs.evaluator", {"replicas": 2}),
        "at most one evaluator",
    ),
    (
        "unknown-role",
        change("spec.replicaSpecs.master", {"replicas": 1}),
        "spec.replicaSpecs.master: Unknown field",
    ),
    (
        "negative-replicas",
        change("spec.replicaSpecs.ps.replicas", -1),
        "spec.replicaSpecs.ps.replicas: Invalid value: -1",
    ),
    (
        "replicas-not-integer",
        change("spec.replicaSpecs.ps.replicas", "2"),
        'spec.replicaSpecs.ps.replicas: Invalid value: "2": spec.replicaSpecs.ps.replicas in body '
        "must be of type integer",
    ),
    (
        "bad-restart-policy",
        change("spec.replicaSpecs.ps.restartPolicy", "Sometimes"),
        'spec.replicaSpecs.ps.restartPolicy: Unsupported value: "Sometimes": supported values: '
        '"Never", "OnFailure", "Always", "ExitCode"',
    ),
    ("bad-mode", change("spec.training.mode", "bulk"), "spec.training.mode: Unsupported value"),
    (
        "replicas-to-aggregate-in-async",
        change("spec.training.replicasToAggregate", 1),
        "replicasToAggregate is only allowed with mode: sync",
    ),
    (
        "max-staleness-in-sync",
        change("spec.training", {"mode": "sync", "maxStaleness": 2}),
        "maxStaleness is only allowed with mode: boundedStaleness",
    ),
    (
        "zero-steps",
        change("spec.training.steps", 0),
        "spec.training.steps: Invalid value: 0: spec.training.steps in body should be greater than "
        "or equal to 1",
    ),
    ("zero-batch-size", change("spec.training.batchSize", 0), "spec.training.batchSize"),
    ("negative-seed", change("spec.training.seed", -3), "spec.training.seed"),
    (
        "unknown-training-field",
        change("spec.training.stepz", 5),
        "spec.training.stepz: Unknown field",
    ),
    (
        "bad-dataset",
        change("spec.training.dataset", {"name": "imagenet"}),
        'spec.training.dataset.name: Unsupported value: "imagenet"',
    ),
    (
        "bad-module",
        change("spec.training.model", {"module": "not a module"}),
        "spec.training.model.module: Invalid value",
    ),
    (
        "bad-placement-strategy",
        change("spec.training.placement", {"strategy": "random"}),
        "spec.training.placement.strategy: Unsupported value",
    ),
    (
        "zero-min-shard-bytes",
        change("spec.training.placement", {"minShardBytes": 0}),
        "spec.training.placement.minShardBytes",
    ),
    (
        "checkpoint-claim-without-dir",
        change("spec.training.checkpoint", {"claimName": "pvc"}),
        "claimName needs dir",
    ),
    (
        "zero-checkpoint-keep",
        change("spec.training.checkpoint", {"dir": "/c", "keep": 0}),
        "spec.training.checkpoint.keep",
    ),
    (
        "rollback-without-checkpoint-dir",
        change("spec.training.onDivergence", "rollback"),
        'spec.training: Invalid value: "object": onDivergence: rollback needs checkpoint.dir',
    ),
    (
        "tensorboard-without-dir",
        change("spec.training.tensorboard", {"flushSeconds": 5}),
        "spec.training.tensorboard.dir: Required value",
    ),
    (
        "zero-tensorboard-flush",
        change("spec.training.tensorboard", {"dir": "/tb", "flushSeconds": 0}),
        "spec.training.tensorboard.flushSeconds: Invalid value: 0",
    ),
    (
        "negative-backoff-limit",
        change("spec.runPolicy", {"backoffLimit": -1}),
        "spec.runPolicy.backoffLimit",
    ),
    (
        "zero-deadline",
        change("spec.runPolicy", {"activeDeadlineSeconds": 0}),
        "spec.runPolicy.activeDeadlineSeconds",
    ),
    (
        "bad-clean-pod-policy",
        change("spec.runPolicy", {"cleanPodPolicy": "Some"}),
        'spec.runPolicy.cleanPodPolicy: Unsupported value: "Some": supported values: "Running", '
        '"All", "None"',
    ),
    (
        "suspend-not-boolean",
        change("spec.runPolicy", {"suspend": "yes"}),
        'spec.runPolicy.suspend: Invalid value: "yes"',
    ),
    (
        "bad-success-policy",
        change("spec.successPolicy", "anyWorker"),
        'spec.successPolicy: Unsupported value: "anyWorker"',
    ),
    ("not-an-object", ["a", "list"], "expected a TrainingJob object"),
]


@pytest.mark.parametrize(
    ("manifest", "message"),
    [(m, msg) for _, m, msg in CATALOGUE],
    ids=[name for name, _, _ in CATALOGUE],
)
def test_invalid_manifests_are_refused_naming_the_field(manifest: Any, message: str) -> None:
    with pytest.raises(schema.InvalidManifestError) as caught:
        schema.validate(manifest)
    assert message in str(caught.value)


def test_the_catalogue_is_large() -> None:
    assert len(CATALOGUE) >= 25


def test_every_problem_is_reported_not_just_the_first() -> None:
    manifest = change("spec.training", {"steps": 0, "batchSize": 0, "mode": "bulk"})
    with pytest.raises(schema.InvalidManifestError) as caught:
        schema.validate(manifest)
    assert {p.path for p in caught.value.problems} == {
        "spec.training.steps",
        "spec.training.batchSize",
        "spec.training.mode",
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_is_valid(path: Path) -> None:
    job = schema.load(path.read_text())
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"  # defaults applied


def test_defaults_are_applied_as_the_apiserver_applies_them() -> None:
    job = schema.validate(GOOD)
    assert job["spec"]["replicaSpecs"]["ps"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["runPolicy"] == {
        "backoffLimit": 6,
        "cleanPodPolicy": "Running",
        "nodeLostSeconds": 60,
        "suspend": False,
    }
    assert job["spec"]["successPolicy"] == "chief"
    assert job["spec"]["training"]["mode"] == "async"
    assert job["spec"]["training"]["batchSize"] == 32
    assert job["spec"]["training"]["model"] == {"name": "mlp"}


def test_tensorboard_gets_its_default_flush_and_the_runtime_accepts_it() -> None:
    job = schema.validate(change("spec.training.tensorboard", {"dir": "/tb"}))
    assert job["spec"]["training"]["tensorboard"] == {"dir": "/tb", "flushSeconds": 5}
    assert schema.training_problems(job) == []


def test_a_training_section_checked_once_is_checked_again_when_it_or_the_replicas_change() -> None:
    job = schema.validate(change("spec.training.steps", 10))
    assert schema.training_problems(job) == []
    assert schema.training_problems(job) == []  # known: the same answer
    job["spec"]["training"]["steps"] = "ten"  # changed in place: no stale answer
    assert any("steps" in str(p) for p in schema.training_problems(job))
    job["spec"]["training"]["steps"] = 10
    job["spec"]["training"]["mode"] = "sync"
    job["spec"]["training"]["replicasToAggregate"] = 2
    assert schema.training_problems(job) == []  # 2 workers
    job["spec"]["replicaSpecs"]["worker"]["replicas"] = 1  # the same section, fewer workers
    assert any("replicasToAggregate" in str(p) for p in schema.training_problems(job))


def test_loading_refuses_a_template_value_the_runtime_would_refuse() -> None:
    manifest = change(
        "spec.replicaSpecs.ps.template",
        {
            "spec": {
                "containers": [
                    {"name": "jaxps", "env": [{"name": "JAXPS_PS_XLA_THREADS", "value": "²"}]}
                ]
            }
        },
    )
    with pytest.raises(schema.InvalidManifestError) as caught:
        schema.load(json.dumps(manifest))
    [problem] = caught.value.problems
    assert problem.path == "spec.replicaSpecs.ps.template.spec.containers[0].env[0].value"
    assert problem.message.startswith(
        'JAXPS_PS_XLA_THREADS: got "\\u00b2"; expected a thread count'
    )


ADAM = "spec.training.optimizer"
RUNTIME_REFUSES: list[tuple[str, dict[str, Any], str]] = [
    (
        "learning-rate-a-string",
        change(ADAM, {"name": "adam", "kwargs": {"learning_rate": "0.01"}}),
        'spec.training.optimizer.kwargs.learning_rate: got "0.01"; expected a finite number > 0',
    ),
    (
        "b1-of-one",
        change(ADAM, {"name": "adam", "kwargs": {"learning_rate": 0.1, "b1": 1}}),
        "spec.training.optimizer.kwargs.b1: got 1; expected a finite number >= 0 and < 1",
    ),
    (
        "a-mask",
        change(ADAM, {"name": "adamw", "kwargs": {"learning_rate": 0.1, "mask": "kernel"}}),
        'spec.training.optimizer.kwargs.mask: got "kernel"; expected null (its default) or no '
        "value",
    ),
    (
        "aggregating-more-workers-than-there-are",
        change("spec.training", {"mode": "sync", "replicasToAggregate": 5}),
        "spec.training.replicasToAggregate: got 5; expected at most the number of workers (2, "
        "spec.replicaSpecs.worker.replicas)",
    ),
    (
        "no-ps",
        change("spec.replicaSpecs.ps", DELETE),
        "spec.replicaSpecs.ps.replicas: got 0; expected an integer >= 1 while there are workers",
    ),
    (
        "zero-ps",
        change("spec.replicaSpecs.ps.replicas", 0),
        "spec.replicaSpecs.ps.replicas: got 0; expected an integer >= 1 while there are workers",
    ),
    (
        "embedding-rows-below-id-range",
        change("spec.training.model", {"name": "embedding", "kwargs": {"rows": 1000}}),
        "spec.training.model.kwargs.rows: got 1000; expected at least "
        "spec.training.dataset.kwargs.idRange (150000)",
    ),
    (
        "embedding-on-digits",
        change(
            "spec.training.model",
            {"name": "embedding"},
            base=change("spec.training.dataset", {"name": "digits"}),
        ),
        'spec.training.dataset.name: got "digits"; expected sparse or your files for model '
        "embedding",
    ),
]


@pytest.mark.parametrize(
    ("manifest", "message"),
    [(m, msg) for _, m, msg in RUNTIME_REFUSES],
    ids=[name for name, _, _ in RUNTIME_REFUSES],
)
def test_what_the_runtime_would_refuse_is_refused_on_loading_naming_the_field(
    manifest: dict[str, Any], message: str
) -> None:
    schema.validate(manifest)  # the CRD's schema takes it: only the runtime's rules refuse it
    with pytest.raises(schema.InvalidManifestError) as caught:
        schema.load(json.dumps(manifest))
    assert any(message in str(p) for p in caught.value.problems), caught.value.problems
    assert schema.training_problems(schema.validate(manifest))  # what the planner calls


def test_validate_exits_2_on_a_string_learning_rate_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(RUNTIME_REFUSES[0][1]))
    assert cli.main(["validate", str(path)]) == cli.EXIT_INVALID == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if "learning_rate" in line]
    assert line.strip().startswith(
        'spec.training.optimizer.kwargs.learning_rate: got "0.01"; expected a finite number > 0'
    )


def test_a_learning_rate_written_with_an_exponent_is_valid_and_reaches_the_runtime(
    tmp_path: Path,
) -> None:
    """PyYAML (YAML 1.1) reads `5e-5` as a string; kubectl reads it as a number, and so must
    `jaxps validate` and `jaxps local`."""
    text = json.dumps(GOOD).replace(
        '"steps": 100',
        '"steps": 100, "optimizer": {"name": "adam", "kwargs": {"learning_rate": 5e-5}}',
    )
    text = text.replace(", ", ",\n")  # JSON is YAML: the number as a YAML reader meets it
    loaded = schema.load(text)
    assert loaded["spec"]["training"]["optimizer"]["kwargs"]["learning_rate"] == 5e-05
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 0


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("spec.training.steps", 10**20),
        ("spec.training.seed", 2**64),
        ("spec.training.steps", -(2**63) - 1),
    ],
)
def test_an_integer_beyond_64_bits_is_refused_naming_its_field(path: str, value: int) -> None:
    """It made every CEL rule report an overflow, none naming the field."""
    with pytest.raises(schema.InvalidManifestError) as caught:
        schema.validate(change(path, value))
    [problem] = caught.value.problems
    assert str(problem).startswith(f"{path}: Invalid value: {value}"), problem
    assert "must be a 64-bit integer" in str(problem)
