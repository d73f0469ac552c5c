"""Every field of the CRD has a description: `hack/docs_reference.py --check` (`make verify`)
names each one that has none, as the reference page would show it with an empty cell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.unit.test_docs import _docs_reference

CRD = Path(__file__).resolve().parents[2] / "crds" / "trainingjob.yaml"
SAID = "has no description: every field is documented in the CRD"


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_the_crd_documents_every_field() -> None:
    assert _docs_reference().undocumented(_schema(yaml.safe_load(CRD.read_text()))) == []


def test_each_field_without_a_description_is_named_under_each_path() -> None:
    role = {"type": "object", "description": "a role", "properties": {"replicas": {}}}
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "description": "the job",
                "properties": {
                    "chief": role,  # one object under two paths, as a YAML alias makes it
                    "ps": role,
                    "steps": {"type": "integer", "description": "how many"},
                    "seed": {"type": "integer", "description": "  "},
                },
            },
            "status": {
                "type": "object",
                "description": "what was seen",
                "properties": {
                    "roles": {
                        "type": "object",
                        "description": "per role",
                        "additionalProperties": {
                            "type": "object",
                            "properties": {"ready": {"type": "integer"}},
                        },
                    },
                },
            },
        },
    }
    assert _docs_reference().undocumented(schema) == [
        "spec.seed",
        "spec.chief.replicas",
        "spec.ps.replicas",
        "status.roles.*.ready",
    ]


def test_check_fails_on_a_field_added_to_the_crd_without_a_description(tmp_path: Path) -> None:
    crd = yaml.safe_load(CRD.read_text())
    training = _schema(crd)["properties"]["spec"]["properties"]["training"]
    training["properties"]["fooBar"] = {"type": "integer"}
    file = tmp_path / "trainingjob.yaml"
    file.write_text(yaml.safe_dump(crd))
    problems = _docs_reference().check(crd=file)
    assert f"{file}: spec.training.fooBar {SAID}" in problems
    assert [line for line in problems if SAID in line] == [f"{file}: spec.training.fooBar {SAID}"]
