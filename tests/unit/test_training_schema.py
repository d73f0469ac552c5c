"""The CRD's `spec.training` says what the runtime reads: the same properties, and for each the
same type, allowed values, default and minimum (`make verify` runs the same check)."""

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
            100,
            "spec.training.steps: default 100 in the CRD, 1000 in the runtime",
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
            'spec.training.dataset.name: default "digits" in the CRD, none (it depends on '
            "another field) in the runtime",
            id="default-that-depends-on-the-model",
        ),
        pytest.param(
            "optimizer.default",
            {},
            "spec.training.optimizer: default {} in the CRD, none in the runtime",
            id="empty-optimizer-is-no-default",
        ),
    ],
)
def test_a_difference_names_the_field(path: str, value: Any, line: str) -> None:
    assert openapi.drift(_changed(path, value)) == [line]


def test_a_section_read_as_empty_when_absent_may_default_to_empty() -> None:
    assert openapi.drift(_changed("placement.default", {})) == []
    assert openapi.drift(_changed("model.default", None)) == []
