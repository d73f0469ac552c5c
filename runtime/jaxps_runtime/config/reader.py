"""How `spec.training` is read: the rules of each field, a reader that applies them with the
field's path in every error, and the list of problems a whole configuration has.

A field's rules live once, on its dataclass field (`setting`): its default (the dataclass
default), its minimum, its allowed values; its type is the field's annotation (`int`: an
integer, `float`: a number, `str` or a `StrEnum`: a string, `X | None`: X or no value).
`Reader.setting` reads a field by those rules, and `openapi` compares the same rules with the
CRD's schema (`make verify`), so the operator, the runtime and the apiserver agree.

Standard library only; pure and thread-safe.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from jaxps_runtime.config import catalog

T = TypeVar("T")
RULES = "jaxps.rules"
"""The key of a dataclass field's metadata that holds its `Rules`."""


class TrainingConfigError(ValueError):
    """The training configuration is invalid. The message names the first problem's field;
    `problems` holds every independent problem found, one line each."""

    def __init__(self, message: str, *, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) or (message,)


def fail(path: str, value: object, expected: str) -> TrainingConfigError:
    return TrainingConfigError(f"{path}: got {json.dumps(value, default=str)}; expected {expected}")


def line(path: str, value: object, expected: str) -> str:
    return str(fail(path, value, expected))


class Rules(NamedTuple):
    """What a field allows beyond its type. `static_default`: False where the dataclass default
    is only a stand-in and the real one depends on another field (a dataset's name: the
    model's; maxStaleness: the mode's), so that a schema must not state it."""

    minimum: float | None = None
    allowed: tuple[str, ...] = ()
    static_default: bool = True


def setting(
    default: Any = dataclasses.MISSING,
    *,
    minimum: float | None = None,
    allowed: tuple[str, ...] = (),
    static_default: bool = True,
) -> Any:
    """A dataclass field with its default and its rules (`Rules`)."""
    rules = Rules(minimum=minimum, allowed=allowed, static_default=static_default)
    return dataclasses.field(default=default, metadata={RULES: rules})


class Spec(NamedTuple):
    """One manifest field as the runtime reads it: `kind` is integer, number, string or
    object; `default` is `dataclasses.MISSING` where the field has no default to state."""

    kind: str
    optional: bool
    default: Any
    rules: Rules
    section: type | None  # the dataclass of an object field read by its own fields
    absent_is_empty: bool = False  # a section read as `{}` when absent (its own defaults)


@functools.cache
def specs(schema: Any) -> Mapping[str, Spec]:
    """Every field of dataclass `schema` as the manifest spells it, in declaration order."""
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        members = [m for m in _members(hints[f.name]) if m is not type(None)]
        optional = len(members) < len(_members(hints[f.name]))
        (kind_type,) = members
        rules: Rules = f.metadata.get(RULES, Rules())
        if isinstance(kind_type, type) and issubclass(kind_type, enum.StrEnum):
            rules = rules._replace(allowed=tuple(m.value for m in kind_type))
            kind_type = str
        section: Any = kind_type if dataclasses.is_dataclass(kind_type) else None
        factory: Any = f.default_factory
        out[f.name] = Spec(
            kind=_KINDS.get(kind_type, "object"),
            optional=optional,
            default=f.default if rules.static_default else dataclasses.MISSING,
            rules=rules,
            section=section,
            absent_is_empty=section is not None and factory is section,
        )
    return out


_KINDS: Mapping[Any, str] = {int: "integer", float: "number", str: "string"}


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


class Reader:
    """Reads one object's keys, with paths in every error; `done` refuses keys that are not
    fields of `schema` (a dataclass; or `keys`, the manifest's keys where they differ from its
    fields), whichever keys were read."""

    def __init__(self, raw: object, path: str, schema: type, *, keys: Sequence[str] = ()) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise fail(path, raw, "an object")
        self.raw, self.path, self.schema = raw, path, schema
        self.allowed = sorted(keys or specs(schema))

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def setting(self, key: str, schema: type | None = None) -> Any:
        """Field `key` of `schema` (default: this reader's), read by its rules; its default
        when absent (None for an optional field)."""
        spec = specs(schema or self.schema)[key]
        default = None if spec.default is dataclasses.MISSING else spec.default
        value: Any
        if spec.kind == "integer":
            value = self.integer(key, default, minimum=int(spec.rules.minimum or 0))
        elif spec.kind == "number":
            if spec.optional and self.get(key) is None:
                return None
            value = self.number(key, default or 0.0, minimum=float(spec.rules.minimum or 0))
        else:
            value = self.string(key, default, allowed=spec.rules.allowed)
        return default if value is None and not spec.optional else value

    def integer(self, key: str, default: int | None, *, minimum: int) -> int | None:
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise fail(f"{self.path}.{key}", value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: float, *, minimum: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail(f"{self.path}.{key}", value, f"a number >= {minimum}")
        if not math.isfinite(value) or value < minimum:
            raise fail(f"{self.path}.{key}", value, f"a number >= {minimum}")
        return float(value)

    def string(self, key: str, default: str | None, *, allowed: tuple[str, ...] = ()) -> str | None:
        value = self.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value or (allowed and value not in allowed):
            what = f"one of {', '.join(allowed)}" if allowed else "a non-empty string"
            raise fail(f"{self.path}.{key}", value, what)
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self.get(key, {})
        if not isinstance(value, Mapping):
            raise fail(f"{self.path}.{key}", value, "an object")
        return dict(value)

    def done(self) -> None:
        unknown = sorted(set(self.raw) - set(self.allowed))
        if unknown:
            raise TrainingConfigError(
                f"{self.path}.{unknown[0]}: unknown field; allowed: {', '.join(self.allowed)}"
            )


class Problems:
    """The problems of one configuration, section by section: a section that fails is recorded
    and stands in as its fallback, so that the sections after it are checked too."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def check(self, fallback: T, read: Callable[[], T]) -> T:
        try:
            return read()
        except (TrainingConfigError, catalog.ModelError, catalog.OptimizerError) as err:
            self.add(err)
            return fallback

    def add(self, problem: Exception) -> None:
        """`problem`, or each of its `problems` (an optimizer's arguments are several)."""
        if isinstance(problem, TrainingConfigError | catalog.OptimizerError):
            self.found += problem.problems
        else:
            self.found.append(str(problem))
