"""How the CRD's schema of `spec.training` differs from what the runtime reads: `make verify`
fails on any difference (`hack/training_schema.py`), naming the field.

Checked, not generated: the CRD is written by hand, and only part of it is the runtime's to
say. Its descriptions, CEL rules (`x-kubernetes-validations`), patterns, lengths and formats
are the apiserver's, in the apiserver's words; what both must say the same is compared here,
field by field: which properties there are, and each one's type, allowed values (`enum`),
default and minimum, as the dataclass fields of `sections`, `mode` and `training` hold them
(`reader.specs`), the one place of the defaults. The CRD may state no default but those; a
section the runtime reads as `{}` when it is absent (model, dataset, placement, checkpoint)
may carry `default: {}`, which changes nothing the runtime reads.

Standard library only; pure.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from jaxps_runtime.config import training
from jaxps_runtime.config.reader import Spec, specs

PATH = "spec.training"
COMPARED = ("type", "enum", "default", "minimum")
_ABSENT = object()


def training_schema(crd: Mapping[str, Any]) -> Mapping[str, Any]:
    """The schema of `spec.training` in `crd` (a CustomResourceDefinition, parsed)."""
    (version,) = crd["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    schema: Mapping[str, Any] = spec["properties"]["training"]
    return schema


def expected(spec: Spec) -> dict[str, Any]:
    """What the CRD should say of one field, for each of `COMPARED` it states."""
    out: dict[str, Any] = {"type": spec.kind}
    if spec.rules.allowed:
        out["enum"] = list(spec.rules.allowed)
    if spec.default is not dataclasses.MISSING and spec.default is not None:
        out["default"] = spec.default
    if spec.rules.minimum is not None:
        out["minimum"] = spec.rules.minimum
    return out


def drift(schema: Mapping[str, Any]) -> list[str]:
    """How `schema` (the CRD's `spec.training`) differs from what the runtime reads, one line
    per difference, each naming the field; [] when they agree."""
    return _properties(schema, training.manifest_specs(), PATH)


def _properties(node: Mapping[str, Any], fields: Mapping[str, Spec], path: str) -> list[str]:
    properties: Mapping[str, Any] = node.get("properties", {})
    lines = []
    for key in [*fields, *(key for key in properties if key not in fields)]:
        where = f"{path}.{key}"
        if key not in properties:
            lines.append(f"{where}: the runtime reads it; the CRD has no such property")
        elif key not in fields:
            lines.append(f"{where}: in the CRD; the runtime refuses it (no such field)")
        else:
            lines += _field(properties[key], fields[key], where)
    return lines


def _field(node: Mapping[str, Any], spec: Spec, where: str) -> list[str]:
    wanted = expected(spec)
    lines = []
    for attribute in COMPARED:
        has, wants = node.get(attribute, _ABSENT), wanted.get(attribute, _ABSENT)
        if attribute == "default" and spec.absent_is_empty and has == {}:
            continue  # the runtime reads an absent section as {}
        if has != wants:  # 5 and 5.0 agree: a number's default
            runtime = _show(wants)
            if attribute == "default" and not spec.rules.static_default:
                runtime += " (it depends on another field)"
            lines.append(f"{where}: {attribute} {_show(has)} in the CRD, {runtime} in the runtime")
    if spec.section is not None:
        lines += _properties(node, specs(spec.section), where)
    return lines


def _show(value: object) -> str:
    return "none" if value is _ABSENT else json.dumps(value, default=str)
