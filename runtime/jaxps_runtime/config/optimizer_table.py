"""The optimizer table: every optax function that takes a `learning_rate`, its parameters,
which are required and what a manifest may give each (`Parameter`: a finite number, an integer
or a boolean, with a range; or only its default, where optax takes what JSON cannot give), read
from `optimizers.json` next to this file; and `check_optimizer`, the one check of a job's
optimizer against it (a string `learning_rate` is refused here, not at the first update).

`catalog` generates the table from the installed optax and checks it for drift (`make
verify`). Standard library only; pure and thread-safe; the table is read once.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

OPTIMIZER_TABLE = Path(__file__).with_name("optimizers.json")


class OptimizerError(ValueError):
    """The optimizer configuration names no optax optimizer or passes it bad arguments. The
    message names the first problem's field; `problems` holds every one found, one line each."""

    def __init__(self, message: str, *, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) or (message,)


NUMBER, INTEGER, BOOLEAN, FIXED = "number", "integer", "boolean", "fixed"
"""What a manifest may give an optax parameter: a finite number, an integer, true or false; or
FIXED: optax takes there something JSON cannot express (a callable, a mask, a dtype, a key),
and only its default may be given, where that default is JSON (null, true)."""


class Bounds(NamedTuple):
    """A range of numbers; None: no bound on that side."""

    minimum: float | None = None
    above: float | None = None  # exclusive minimum
    maximum: float | None = None
    below: float | None = None  # exclusive maximum

    def holds(self, value: float) -> bool:
        return (
            (self.minimum is None or value >= self.minimum)
            and (self.above is None or value > self.above)
            and (self.maximum is None or value <= self.maximum)
            and (self.below is None or value < self.below)
        )

    def __str__(self) -> str:
        parts = [
            f"{sign} {_number(bound)}"
            for sign, bound in (
                (">=", self.minimum),
                (">", self.above),
                ("<=", self.maximum),
                ("<", self.below),
            )
            if bound is not None
        ]
        return " and ".join(parts)


class Parameter(NamedTuple):
    """What a manifest may give one keyword parameter of an optax optimizer (JSON values).

    `kind`: NUMBER, INTEGER, BOOLEAN or FIXED; `nullable`: null is allowed too; `bounds`: the
    range of a NUMBER or INTEGER; `schedule`: optax also takes a schedule (a callable of the
    step) there; `takes`: what optax takes where JSON cannot follow (FIXED); `allowed`: the
    only values a FIXED parameter may be given (its default, when that is JSON)."""

    kind: str
    nullable: bool = False
    bounds: Bounds = Bounds()
    schedule: bool = False
    takes: str = ""
    allowed: tuple[Any, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.nullable:
            out["nullable"] = True
        names = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
        out.update({k: v for k, v in zip(names, self.bounds, strict=True) if v is not None})
        if self.schedule:
            out["schedule"] = True
        if self.kind == FIXED:
            out["takes"], out["allowed"] = self.takes, list(self.allowed)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Parameter:
        return cls(
            kind=raw["type"],
            nullable=raw.get("nullable", False),
            bounds=Bounds(
                minimum=raw.get("minimum"),
                above=raw.get("exclusiveMinimum"),
                maximum=raw.get("maximum"),
                below=raw.get("exclusiveMaximum"),
            ),
            schedule=raw.get("schedule", False),
            takes=raw.get("takes", ""),
            allowed=tuple(raw.get("allowed", ())),
        )

    def problem(self, where: str, value: object, *, optimizer: str) -> str | None:
        """None when `value` is allowed; else the message naming `where`, the value and what
        is allowed."""
        got = json.dumps(value, default=str)
        if self.kind == FIXED:
            if any(value is allowed for allowed in self.allowed):  # null, true: singletons
                return None
            given = " or ".join(json.dumps(a) for a in self.allowed)
            what = f"{given} (its default) or no value" if given else "no value (leave it out)"
            return (
                f"{where}: got {got}; expected {what}: optax.{optimizer} takes {self.takes} "
                "here, which a manifest cannot give"
            )
        if self._fits(value):
            return None
        what = {BOOLEAN: "true or false", INTEGER: "an integer"}.get(self.kind, "a finite number")
        if self.bounds != Bounds():
            what += f" {self.bounds}"
        if self.nullable:
            what = f"null or {what}"
        if self.schedule:
            what += (
                f" (optax.{optimizer} also takes a schedule, a callable of the step, which "
                "JSON cannot express)"
            )
        return f"{where}: got {got}; expected {what}"

    def _fits(self, value: object) -> bool:
        if value is None or isinstance(value, bool):  # a bool is no number here
            return (value is None and self.nullable) or self.kind == BOOLEAN
        if self.kind == BOOLEAN or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and (self.kind == INTEGER or not math.isfinite(value)):
            return False
        return self.bounds.holds(value)


class Optimizer(NamedTuple):
    """An optax optimizer's keyword parameters, in signature order, and the required ones."""

    parameters: Mapping[str, Parameter]
    required: tuple[str, ...]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


@functools.cache
def optimizers() -> Mapping[str, Optimizer]:
    """Every optax optimizer a job may name, by name (sorted), from `OPTIMIZER_TABLE`."""
    return MappingProxyType(table_from_json(OPTIMIZER_TABLE.read_text()))


def check_optimizer(name: object, kwargs: Mapping[str, Any], *, where: str = "optimizer") -> str:
    """`name`, once known to be an optimizer of the table that takes every argument in `kwargs`
    with a value JSON can give it (its type and range, from the table), and finds its required
    ones there. Raises `OptimizerError` naming the first problem; its `problems` names every
    argument's. What only optax can judge is judged at task start (`optim.build`)."""
    table = optimizers()
    if not isinstance(name, str) or name not in table:
        raise OptimizerError(
            f"{where}.name: got {json.dumps(name, default=str)}; expected one of {', '.join(table)}"
        )
    optimizer = table[name]
    found = []
    for key, value in kwargs.items():
        parameter = optimizer.parameters.get(key)
        if parameter is None:
            found.append(
                f"{where}.kwargs.{key}: optax.{name} has no argument {key!r}; "
                f"allowed: {', '.join(optimizer.parameters)}"
            )
        else:
            found.append(parameter.problem(f"{where}.kwargs.{key}", value, optimizer=name) or "")
    found += [
        f"{where}.kwargs.{key}: missing; optax.{name} requires {', '.join(optimizer.required)}"
        for key in optimizer.required
        if key not in kwargs
    ]
    found = [problem for problem in found if problem]
    if found:
        raise OptimizerError(found[0], problems=found)
    return name


def table_from_json(text: str) -> dict[str, Optimizer]:
    raw = json.loads(text)["optimizers"]
    return {
        name: Optimizer(
            parameters={k: Parameter.from_json(p) for k, p in entry["parameters"].items()},
            required=tuple(entry["required"]),
        )
        for name, entry in sorted(raw.items())
    }
