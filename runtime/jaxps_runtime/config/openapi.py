"""How the CRD's schema of `spec.training` differs from what the runtime reads: `make verify`
fails on any difference (`hack/training_schema.py`), naming the field.

Checked, not generated: the CRD is written by hand, and only part of it is the runtime's to
say. Its descriptions, CEL rules (`x-kubernetes-validations`), patterns, lengths and formats
are the apiserver's, in the apiserver's words; what both must say the same is compared here,
field by field: which properties there are, and each one's type, allowed values (`enum`) and
minimum, as the dataclass fields of `sections`, `mode` and `training` hold them
(`reader.specs`). The CRD states no default: the dataclasses are the one place of the
defaults, which the operator fills in (`training.with_defaults`). A default in the schema
would be stored by the apiserver in every job, and each write of a job (every status update
included) costs the apiserver more CPU the more fields the job holds.

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
COMPARED = ("type", "enum", "minimum")
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
    if spec.rules.minimum is not None:
        out["minimum"] = spec.rules.minimum
    return out


def drift(schema: Mapping[str, Any]) -> list[str]:
    """How `schema` (the CRD's `spec.training`) differs from what the runtime reads, one line
    per difference, each naming the field; [] when they agree."""
    fields = training.manifest_specs()
    return _properties(schema, fields, PATH) + _described(schema, fields)


def _described(schema: Mapping[str, Any], fields: Mapping[str, Spec]) -> list[str]:
    """The description of `spec.training` (what `kubectl explain` shows) names each default
    of a top-level field as `name value`, as the CRD states none."""
    text = str(schema.get("description", ""))
    lines = []
    for key, spec in fields.items():
        if spec.section is None and spec.default not in (dataclasses.MISSING, None):
            value = spec.default
            said = f"{value:g}" if isinstance(value, float) else str(getattr(value, "value", value))
            if f"{key} {said}" not in text:
                lines.append(f"{PATH}: the description does not say the default of {key} ({said})")
    return lines


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
    if "default" in node:
        runtime = "none" if spec.default in (dataclasses.MISSING, None) else _show(spec.default)
        if not spec.rules.static_default:
            runtime += " (it depends on another field)"
        lines.append(
            f"{where}: default {_show(node['default'])} in the CRD: state none "
            f"(the runtime's, {runtime}, applies; the apiserver would store it in every job)"
        )
    for attribute in COMPARED:
        has, wants = node.get(attribute, _ABSENT), wanted.get(attribute, _ABSENT)
        if has != wants:  # 5 and 5.0 agree: a minimum
            runtime = _show(wants)
            lines.append(f"{where}: {attribute} {_show(has)} in the CRD, {runtime} in the runtime")
    if spec.section is not None:
        lines += _properties(node, specs(spec.section), where)
    return lines


def _show(value: object) -> str:
    return "none" if value is _ABSENT else json.dumps(value, default=str)
