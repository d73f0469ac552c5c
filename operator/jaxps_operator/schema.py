"""Validating a TrainingJob against the CRD's schema, as a kube-apiserver would, offline.

The CRD (`crds/trainingjob.yaml`, packaged as `crd/trainingjob.yaml`) is the only source of
the rules. `validate` applies its defaults (structural defaulting, as the apiserver does before
validating), then checks types, enums, bounds, patterns, required and unknown fields, and
finally evaluates every `x-kubernetes-validations` CEL rule with cel-python. Every problem is
reported, each with the field path, the value and what is allowed, in the apiserver's words
(`spec.replicaSpecs.worker.replicas: Invalid value: 0: ...`). Last it fills in the defaults of
`spec.training`, which the CRD leaves to the runtime (`jaxps_runtime.config.training.
with_defaults`: the apiserver stores only what the user wrote).

Pure functions; thread-safe.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from jaxps_operator import builders
from jaxps_runtime.config import yamltext

GROUP, VERSION, KIND, PLURAL = "jaxps.dev", "v1alpha1", "TrainingJob", "trainingjobs"
INT64 = (-(2**63), 2**63 - 1)  # an integer field's range, as Kubernetes stores it
API_VERSION = f"{GROUP}/{VERSION}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class InvalidManifestError(ValueError):
    """A manifest the apiserver would refuse; `problems` lists every reason."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


@functools.cache
def crd() -> dict[str, Any]:
    text = resources.files("jaxps_operator").joinpath("crd/trainingjob.yaml").read_text()
    # libyaml's loader where PyYAML has it: the CRD is large, and Python's loader took a
    # tenth of a second of the operator's start
    loaded: dict[str, Any] = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return loaded


def openapi_schema() -> dict[str, Any]:
    schema: dict[str, Any] = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _show(value: Any) -> str:
    if isinstance(value, Mapping):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return json.dumps(value)


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
}


def _default(node: Any, schema: Mapping[str, Any]) -> Any:
    """Fills absent properties that have defaults, recursively (structural defaulting)."""
    if isinstance(node, dict) and schema.get("type") == "object":
        for key, sub in schema.get("properties", {}).items():
            if key not in node and "default" in sub:
                node[key] = copy.deepcopy(sub["default"])
            if key in node:
                node[key] = _default(node[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key in node:
                node[key] = _default(node[key], extra)
    elif isinstance(node, list) and "items" in schema:
        return [_default(item, schema["items"]) for item in node]
    return node


def _check(node: Any, schema: Mapping[str, Any], path: str, out: list[Problem]) -> None:
    kind = schema.get("type")
    if kind:
        ok = isinstance(node, _TYPES[kind]) and not (
            kind in ("integer", "number") and isinstance(node, bool)
        )
        if not ok:
            out.append(
                Problem(
                    path, f"Invalid value: {_show(node)}: {path} in body must be of type {kind}"
                )
            )
            return
    if kind == "integer" and not INT64[0] <= node <= INT64[1]:
        out.append(  # the apiserver's JSON decoder refuses it; its CEL rules would overflow
            Problem(
                path,
                f"Invalid value: {_show(node)}: {path} in body must be a 64-bit integer "
                f"({INT64[0]}..{INT64[1]})",
            )
        )
        return
    if "enum" in schema and node not in schema["enum"]:
        allowed = ", ".join(json.dumps(v) for v in schema["enum"])
        about = f" ({schema['description']})" if schema.get("description") else ""
        out.append(
            Problem(path, f"Unsupported value: {_show(node)}: supported values: {allowed}{about}")
        )
    if isinstance(node, int | float) and not isinstance(node, bool):
        if "minimum" in schema and node < schema["minimum"]:
            out.append(
                Problem(
                    path,
                    f"Invalid value: {_show(node)}: {path} in body should be "
                    f"greater than or equal to {schema['minimum']}",
                )
            )
        if "maximum" in schema and node > schema["maximum"]:
            out.append(
                Problem(
                    path,
                    f"Invalid value: {_show(node)}: {path} in body should be "
                    f"less than or equal to {schema['maximum']}",
                )
            )
    if isinstance(node, str):
        if "minLength" in schema and len(node) < schema["minLength"]:
            out.append(
                Problem(
                    path,
                    f"Invalid value: {_show(node)}: {path} in body should be "
                    f"at least {schema['minLength']} chars long",
                )
            )
        if "pattern" in schema and not re.search(schema["pattern"], node):
            out.append(
                Problem(
                    path,
                    f"Invalid value: {_show(node)}: {path} in body should "
                    f"match '{schema['pattern']}'",
                )
            )
    if isinstance(node, dict):
        for key in schema.get("required", []):
            if key not in node:
                out.append(Problem(f"{path}.{key}".lstrip("."), "Required value"))
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in node.items():
            where = f"{path}.{key}".lstrip(".")
            if key in properties:
                _check(value, properties[key], where, out)
            elif isinstance(extra, Mapping):
                _check(value, extra, where, out)
            elif (
                not schema.get("x-kubernetes-preserve-unknown-fields")
                and (properties or extra is False)
                and path != "metadata"
            ):
                allowed = ", ".join(sorted(properties))
                out.append(Problem(where, f"Unknown field: allowed fields here are {allowed}"))
    if isinstance(node, list) and "items" in schema:
        for i, item in enumerate(node):
            _check(item, schema["items"], f"{path}[{i}]", out)


@functools.cache
def _program(rule: str) -> Any:
    import celpy  # noqa: PLC0415 (8 MB the operator, which runs no rule, never loads)

    env = celpy.Environment()
    return env.program(env.compile(rule))


def compile_rules() -> int:
    """Compiles every CEL rule of the CRD now (each is compiled once, at its first use, which
    otherwise made the first job's pass 0.15 s slower); the number of rules."""
    rules = []
    stack: list[Any] = [openapi_schema()]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []):
                rules += [
                    rule["rule"],
                    *([rule["messageExpression"]] if "messageExpression" in rule else []),
                ]
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    for rule in rules:
        _program(rule)
    return len(rules)


_ABSENT = object()  # no old object at a path: a transition rule there is not checked


def _evaluate(expression: str, activation: Mapping[str, Any]) -> Any:
    import celpy  # noqa: PLC0415 (see `_program`)

    to_cel = celpy.json_to_cel  # type: ignore[attr-defined]
    return _program(expression).evaluate({k: to_cel(v) for k, v in activation.items()})


def _rules(
    node: Any, schema: Mapping[str, Any], path: str, out: list[Problem], *, old: Any = _ABSENT
) -> None:
    """Evaluates the CEL rules, children first; a node that failed its type is skipped. A
    transition rule (one that reads `oldSelf`) is checked only on an update, where `old` holds
    the stored value at this path, as the apiserver does; `messageExpression`, `fieldPath` and
    `reason` (FieldValueForbidden) are honoured."""
    if isinstance(node, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in node:
                before = old[key] if isinstance(old, dict) and key in old else _ABSENT
                _rules(node[key], sub, f"{path}.{key}".lstrip("."), out, old=before)
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is _ABSENT:
            continue
        activation = {"self": node, **({"oldSelf": old} if transition else {})}
        try:
            ok = _evaluate(rule["rule"], activation)
        except Exception as err:  # a rule that cannot be evaluated counts as failed
            ok = False
            message = (
                f"{rule.get('message', rule['rule'])} (the rule could not be evaluated: {err})"
            )
        else:
            message = rule.get("message", f"failed rule: {rule['rule']}")
            if not ok and rule.get("messageExpression"):
                with contextlib.suppress(Exception):  # the apiserver falls back to message
                    message = str(_evaluate(rule["messageExpression"], activation))
        if not ok:
            where = f"{path}{rule.get('fieldPath', '')}".lstrip(".")
            if rule.get("reason") == "FieldValueForbidden":
                out.append(Problem(where, f"Forbidden: {message}"))
            else:
                out.append(Problem(where, f"Invalid value: {_show(node)}: {message}"))


def validate(
    manifest: Any, *, old: Mapping[str, Any] | None = None, rules: bool = True
) -> dict[str, Any]:
    """The manifest with the CRD's defaults applied, and the runtime's in `spec.training` (which
    the CRD leaves out: `jaxps_runtime.config.openapi`); `InvalidManifestError` lists every problem.
    `old`: the stored job this manifest would replace (an update): the transition rules (a ps
    count that changes) are checked against it, as the apiserver checks them. `rules=False`:
    the CEL rules are not evaluated (for an object the apiserver admitted under them)."""
    if not isinstance(manifest, Mapping):
        raise InvalidManifestError(
            [Problem("", f"expected a {KIND} object, got {_show(manifest)}")]
        )
    problems: list[Problem] = []
    if manifest.get("apiVersion") != API_VERSION:
        problems.append(
            Problem(
                "apiVersion",
                f"Unsupported value: {_show(manifest.get('apiVersion'))}"
                f': supported values: "{API_VERSION}"',
            )
        )
    if manifest.get("kind") != KIND:
        problems.append(
            Problem(
                "kind",
                f'Unsupported value: {_show(manifest.get("kind"))}: supported values: "{KIND}"',
            )
        )
    metadata = manifest.get("metadata")
    if (
        not isinstance(metadata, Mapping)
        or not isinstance(metadata.get("name"), str)
        or not metadata.get("name")
    ):
        problems.append(Problem("metadata.name", "Required value: name is required"))
    if problems:
        raise InvalidManifestError(problems)
    schema = openapi_schema()
    job: dict[str, Any] = _default(copy.deepcopy(dict(manifest)), schema)
    _check(job, schema, "", problems)
    if rules and not problems:  # CEL rules assume well-typed input, as the apiserver's do
        before = (
            _default(copy.deepcopy({k: v for k, v in old.items() if k != "status"}), schema)
            if old is not None
            else _ABSENT
        )
        _rules(job, schema, "", problems, old=before)
    if problems:
        raise InvalidManifestError(problems)
    training = job["spec"].get("training")
    if isinstance(training, Mapping):  # the CRD states none of its defaults: the runtime's
        from jaxps_runtime.config import training as config  # noqa: PLC0415 - as below

        job["spec"]["training"] = config.with_defaults(training)
    return job


def training_problems(job: Mapping[str, Any]) -> list[Problem]:
    """What the runtime would refuse, crash or hang on in `spec.training` of a valid job (names
    of built-in models, datasets and optimizers, their arguments' types and ranges, every
    cross-field rule), and in how it meets `spec.replicaSpecs` (a ps to keep the parameters,
    replicasToAggregate at most the workers: `config.replica_problems`), found without JAX:
    `jaxps_runtime.config` is standard library (and YAML) only."""
    specs = job["spec"].get("replicaSpecs") or {}
    workers, ps = _replicas(specs, "worker"), _replicas(specs, "ps")
    raw = job["spec"].get("training") or {}
    try:  # asked on every pass of every job (80 us): checked once per distinct section
        key = (json.dumps(raw), workers, ps)
    except (TypeError, ValueError):  # not JSON (a YAML date, say): nothing to know it again by
        return list(_training_problems(raw, workers, ps))
    found = _TRAINING_CHECKED.get(key)
    if found is None:
        if len(_TRAINING_CHECKED) >= TRAINING_CHECKED_MAX:
            _TRAINING_CHECKED.clear()
        found = _TRAINING_CHECKED[key] = _training_problems(raw, workers, ps)
    return list(found)


TRAINING_CHECKED_MAX = 1024
_TRAINING_CHECKED: dict[tuple[str, int, int], tuple[Problem, ...]] = {}


def _training_problems(raw: Any, workers: int, ps: int) -> tuple[Problem, ...]:
    from jaxps_runtime.config import training as config  # noqa: PLC0415 - only where training is checked

    tasks = config.Replicas(workers=workers, ps=ps)
    out = []
    for text in config.problems(raw, path="spec.training", replicas=tasks):
        path, _, message = text.partition(": ")
        out.append(Problem(path, message) if message else Problem("", text))
    return tuple(out)


def _replicas(specs: Mapping[str, Any], role: str) -> int:
    """The replicas of `role` after defaulting: 0 when the role is absent."""
    spec = specs.get(role)
    replicas = spec.get("replicas", 1) if isinstance(spec, Mapping) else 0
    return replicas if isinstance(replicas, int) else 0


def setting_problems(job: Mapping[str, Any]) -> list[Problem]:
    """What the runtime would refuse among its own variables in each role's template (the
    first container, where `builders.pod` runs it): `jaxps_runtime.config.cluster.setting_problem`.
    A value from `valueFrom` is only known in the pod, which checks it itself (exit 2)."""
    from jaxps_runtime.config import cluster  # noqa: PLC0415 - only where templates are checked

    def field(node: Any, key: str) -> Any:
        return node.get(key) if isinstance(node, Mapping) else None

    out = []
    for role, spec in sorted((job["spec"].get("replicaSpecs") or {}).items()):
        containers = field(field(field(spec, "template"), "spec"), "containers")
        if not isinstance(containers, list) or not containers:
            continue
        main = builders.main_index(containers)
        env = field(containers[main], "env") if main is not None else None
        for i, var in enumerate(env if isinstance(env, list) else []):
            name, value = field(var, "name"), field(var, "value")
            if not isinstance(name, str) or not isinstance(value, str):
                continue
            problem = cluster.setting_problem(name, value, task_type=role)
            if problem is not None:
                path = f"spec.replicaSpecs.{role}.template.spec.containers[{main}].env[{i}].value"
                out.append(Problem(path, problem))
    return out


def container_problems(job: Mapping[str, Any]) -> list[Problem]:
    """A role's template with several containers, none of them named `jaxps`: which one jaxps
    runs in is not said (`builders.main_index`), so no pod of it could be built."""
    out = []
    for role, spec in sorted((job["spec"].get("replicaSpecs") or {}).items()):
        pod_spec = ((spec or {}).get("template") or {}).get("spec") or {}
        containers = pod_spec.get("containers") if isinstance(pod_spec, Mapping) else None
        if isinstance(containers, list) and builders.main_index(containers) is None:
            names = ", ".join(
                _show(c.get("name")) if isinstance(c, Mapping) else _show(c) for c in containers
            )
            out.append(
                Problem(
                    f"spec.replicaSpecs.{role}.template.spec.containers",
                    f"Invalid value: {len(containers)} containers ({names}) and none named "
                    f'"{builders.MAIN_CONTAINER}": name the container jaxps runs in '
                    f'"{builders.MAIN_CONTAINER}" (the others keep their own image and command)',
                )
            )
    return out


def load(text: str) -> dict[str, Any]:
    """Parses one YAML or JSON manifest and validates it: the CRD's schema, then (when that
    passes) what the runtime would refuse in `spec.training` and in its templates' settings."""
    try:
        docs = [d for d in yamltext.load_all(text) if d is not None]
    except yamltext.Error as err:
        raise InvalidManifestError([Problem("", f"not YAML: {err}")]) from err
    if len(docs) != 1:
        raise InvalidManifestError(
            [Problem("", f"expected one {KIND} document, found {len(docs)}")]
        )
    job = validate(docs[0])
    problems = container_problems(job) + training_problems(job) + setting_problems(job)
    if problems:
        raise InvalidManifestError(problems)
    return job
