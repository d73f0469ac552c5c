"""The CRD's `spec.training` says what the runtime reads: the same properties, and for each the
same type, allowed values and minimum, and no default (the runtime's apply, filled in by the
operator, never stored by the apiserver); `make verify` runs the same check."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from jaxps_runtime.config import openapi

CRD = Path(__file__).resolve().parents[2] / "crds" / "trainingjob.yaml"


def _schema() -> dict[str, Any]:
    return copy.deepcopy(dict(openapi.training_schema(yaml.safe_load(CRD.read_text()))))


def _changed(path: str, value: Any) -> dict[str, Any]:
    """The CRD's schema with `value` at `path` (dotted, through `properties`); None deletes."""
    schema = _schema()
    *parents, last = path.split(".")
    node = schema
    for key in parents:
        node = node["properties"][key] if key in node.get("properties", {}) else node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return schema


def test_the_crd_says_what_the_runtime_reads() -> None:
    assert openapi.drift(_schema()) == []


@pytest.mark.parametrize(
    ("path", "value", "line"),
    [
        pytest.param(
            "steps.default",
            1000,
            "spec.training.steps: default 1000 in the CRD: state none (the runtime's, 1000, "
            "applies; the apiserver would store it in every job)",
            id="default",
        ),
        pytest.param(
            "placement.minShardBytes.minimum",
            2,
            "spec.training.placement.minShardBytes: minimum 2 in the CRD, 1 in the runtime",
            id="minimum-of-a-section",
        ),
        pytest.param(
            "mode.enum",
            ["sync", "async"],
            'spec.training.mode: enum ["sync", "async"] in the CRD, '
            '["sync", "async", "boundedStaleness"] in the runtime',
            id="enum",
        ),
        pytest.param(
            "tensorboard.flushSeconds.type",
            "number",
            'spec.training.tensorboard.flushSeconds: type "number" in the CRD, "integer" in the '
            "runtime",
            id="type",
        ),
        pytest.param(
            "properties.maxRollbacks",
            None,
            "spec.training.maxRollbacks: the runtime reads it; the CRD has no such property",
            id="missing-property",
        ),
        pytest.param(
            "properties.stepz",
            {"type": "integer"},
            "spec.training.stepz: in the CRD; the runtime refuses it (no such field)",
            id="extra-property",
        ),
        pytest.param(
            "dataset.name.default",
            "digits",
            'spec.training.dataset.name: default "digits" in the CRD: state none (the runtime\'s, '
            "none (it depends on another field), applies; the apiserver would store it in every "
            "job)",
            id="default-that-depends-on-the-model",
        ),
        pytest.param(
            "optimizer.default",
            {},
            "spec.training.optimizer: default {} in the CRD: state none (the runtime's, none, "
            "applies; the apiserver would store it in every job)",
            id="empty-optimizer-is-no-default",
        ),
    ],
)
def test_a_difference_names_the_field(path: str, value: Any, line: str) -> None:
    assert openapi.drift(_changed(path, value)) == [line]


def test_every_default_the_crd_states_is_named() -> None:
    schema = _changed("placement.default", {})
    schema["properties"]["model"]["properties"]["name"]["default"] = "mlp"
    assert openapi.drift(schema) == [
        'spec.training.model.name: default "mlp" in the CRD: state none (the runtime\'s, '
        '"mlp", applies; the apiserver would store it in every job)',
        "spec.training.placement: default {} in the CRD: state none (the runtime's, none, "
        "applies; the apiserver would store it in every job)",
    ]


def test_the_defaults_filled_in_are_the_runtimes() -> None:
    from jaxps_runtime.config import training

    raw = {"steps": 5, "placement": {"strategy": "roundRobin"}, "tensorboard": {"dir": "/tb"}}
    kept = copy.deepcopy(raw)
    filled = training.with_defaults(raw)
    assert raw == kept
    assert training.parse(filled).to_dict() == training.parse(raw).to_dict()
    assert (filled["steps"], filled["batchSize"], filled["mode"]) == (5, 32, "async")
    assert filled["placement"] == {"strategy": "roundRobin", "minShardBytes": 262144}
    assert filled["tensorboard"] == {"dir": "/tb", "flushSeconds": 5}
    assert "maxStaleness" not in filled  # its default depends on the mode
    assert "checkpoint" not in filled  # a section it does not have
    assert training.with_defaults({"steps": "many"})["steps"] == "many"  # for problems to name


def test_the_description_says_each_default() -> None:
    schema = _schema()
    schema["description"] = schema["description"].replace("batchSize 32", "batchSize 64")
    assert openapi.drift(schema) == [
        "spec.training: the description does not say the default of batchSize (32)"
    ]
