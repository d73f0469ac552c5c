"""What jaxps has built in, by name: models, datasets, placement strategies, optax optimizers.

Standard library only (an import-linter contract keeps it so): the operator checks a
TrainingJob's `spec.training` with this module where JAX, optax and numpy are not installed, and
the runtime checks the same things with the same code (`config`, `models`), so a job is refused
with the same words before it starts as at its start.

* Models and datasets: their names, the dataset each model trains on by default, and each
  built-in's keyword arguments (manifest spelling) with their defaults and checks.
  `check_model` / `check_dataset` return the complete, checked keyword arguments or raise
  `ModelError`, whose message names the field, the value and what is allowed.
* Optimizers: every optax function that takes a `learning_rate`, with its parameters, which
  of them are required and what a manifest may give each (`Parameter`: a finite number, an
  integer or a boolean, from optax's annotation; a range from `BOUNDS`, by name; or only its
  default, where optax takes what a manifest cannot give: a callable, a mask, a dtype, a key),
  read from `optimizers.json` next to this file. `check_optimizer` refuses a string
  `learning_rate` here, where a task would take it and fail at its first update. That table
  is generated from the installed optax: `python -m jaxps_runtime.config --write` writes it
  and `--check` (in `make verify`) exits 1 naming what drifted. Only those two read optax,
  inside the function that does it.

Pure and thread-safe; the optimizer table is read once.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import re
import sys
import types
import typing
from collections import abc
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

GREEDY = "greedy"
ROUND_ROBIN = "roundRobin"
STRATEGIES = (GREEDY, ROUND_ROBIN)
DEFAULT_MIN_SHARD_BYTES = 256 << 10  # TensorFlow's MinSizePartitioner default

OPTIMIZER_TABLE = Path(__file__).with_name("optimizers.json")
_MODULE_FORM = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class ModelError(ValueError):
    """Bad model or dataset configuration; the message names the field, the value and what is
    allowed."""


class OptimizerError(ValueError):
    """The optimizer configuration names no optax optimizer or passes it bad arguments. The
    message names the first problem's field; `problems` holds every one found, one line each."""

    def __init__(self, message: str, *, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) or (message,)


# --- checks of one keyword argument -----------------------------------------------------------


def options(where: str, given: object, *, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`defaults` overridden by `given`; refuses keys `defaults` lacks."""
    if given is None:
        return dict(defaults)
    if not isinstance(given, Mapping):
        raise ModelError(f"{where}: expected an object of keyword arguments, got {given!r}")
    for key in given:
        if key not in defaults:
            raise ModelError(
                f"{where}.{key}: unknown argument {key!r}; allowed: {', '.join(defaults)}"
            )
    return {**defaults, **given}


def count(where: str, value: object, *, minimum: int = 1) -> int:
    """`value` as an integer >= `minimum` (a bool is no integer here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def widths(where: str, value: object) -> tuple[int, ...]:
    """`value` as a list of layer widths, each an integer >= 1."""
    if not isinstance(value, list | tuple):
        raise ModelError(f"{where}: expected a list of layer widths (integers >= 1), got {value!r}")
    return tuple(count(f"{where}[{i}]", width) for i, width in enumerate(value))


def fraction(where: str, value: object) -> float:
    """`value` as a number strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ModelError(f"{where}: expected a number strictly between 0 and 1, got {value!r}")
    return float(value)


def _classes(where: str, value: object) -> int:
    return count(where, value, minimum=2)


def path(where: str, value: object) -> str:
    """A file or directory the tasks read (whether it is there is known where they run)."""
    if not isinstance(value, str) or not value.strip():
        raise ModelError(
            f"{where}: expected the path of a file or directory every task can read (a "
            f"volume each pod mounts; locally any directory), got {value!r}"
        )
    return value


def optional_path(where: str, value: object) -> str | None:
    return None if value is None else path(where, value)


def optional_count(where: str, value: object) -> int | None:
    return None if value is None else count(where, value)


def _fallback(where: str, value: object) -> str | None:
    """None, or a built-in dataset that needs no files (used when the files are absent)."""
    allowed = tuple(d for d in DATASETS if d not in FILE_DATASETS)
    if value is not None and value not in allowed:
        raise ModelError(
            f"{where}: {value!r} is not a built-in dataset without files; allowed: "
            f"{', '.join(allowed)}, or leave it out to require the files"
        )
    return None if value is None else str(value)


def batch_keys(where: str, value: object) -> dict[str, str] | None:
    """None (every array under its own name), or {batch key: array name}."""
    if value is None:
        return None
    if (
        not isinstance(value, Mapping)
        or not value
        or not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in value.items())
    ):
        raise ModelError(
            f"{where}: expected an object mapping each batch key to an array name "
            f"(e.g. {{x: images, y: labels}}), got {value!r}"
        )
    return dict(value)


# --- models and datasets ----------------------------------------------------------------------


class Argument(NamedTuple):
    """One keyword argument of a built-in: its default and its check, `check(field, value)`."""

    default: Any
    check: Callable[[str, Any], Any]


MODEL_ARGUMENTS: Mapping[str, Mapping[str, Argument]] = {
    "linear": {"features": Argument(16, count)},
    "mlp": {
        "hidden": Argument((64,), widths),
        # None: the width of the dataset's `x` (64 without a dataset, the digits' width)
        "inputs": Argument(None, optional_count),
        "classes": Argument(10, _classes),
    },
    "embedding": {
        "rows": Argument(200_000, count),
        "dim": Argument(16, count),
        "idsPerExample": Argument(4, count),
    },
}
DATASET_ARGUMENTS: Mapping[str, Mapping[str, Argument]] = {
    "synthetic": {
        "features": Argument(16, count),
        "examples": Argument(4096, count),
        "testExamples": Argument(1024, count),
    },
    "digits": {"testFraction": Argument(0.2, fraction)},
    "sparse": {
        "idRange": Argument(150_000, count),
        "idsPerExample": Argument(4, count),
        "examples": Argument(100_000, count),
        "testExamples": Argument(5000, count),
    },
    # the user's files (jaxps_runtime.data.files)
    "arrays": {
        "path": Argument(None, path),
        "test": Argument(None, optional_path),
        "keys": Argument(None, batch_keys),
        "testFraction": Argument(0.2, fraction),
    },
    "parquet": {
        "path": Argument(None, path),
        "test": Argument(None, optional_path),
        "columns": Argument(None, batch_keys),
        "testFraction": Argument(0.2, fraction),
    },
    # `fallback`: the built-in trained on when `dir` holds none of the four files
    "idx": {"dir": Argument(None, path), "fallback": Argument(None, _fallback)},
}
MODELS: tuple[str, ...] = tuple(MODEL_ARGUMENTS)
DATASETS: tuple[str, ...] = tuple(DATASET_ARGUMENTS)
FILE_DATASETS: tuple[str, ...] = ("arrays", "parquet", "idx")  # read by jaxps_runtime.data.files
DEFAULT_DATASET: Mapping[str, str] = {"linear": "synthetic", "mlp": "digits", "embedding": "sparse"}


def _checked(where: str, given: object, arguments: Mapping[str, Argument]) -> dict[str, Any]:
    defaults = {key: argument.default for key, argument in arguments.items()}
    chosen = options(where, given, defaults=defaults)
    return {key: arguments[key].check(f"{where}.{key}", value) for key, value in chosen.items()}


def check_model(name: object, kwargs: object, *, where: str = "model") -> dict[str, Any]:
    """The complete keyword arguments of built-in model `name`: `kwargs` (None: none) over the
    defaults, every one checked (names, types, bounds). Errors name `<where>.name` or
    `<where>.kwargs.<key>`."""
    if not isinstance(name, str) or name not in MODEL_ARGUMENTS:
        raise ModelError(
            f"{where}.name: {name!r} is not a built-in model; allowed: {', '.join(MODELS)} "
            f"(or set {where}.module to 'package.module:factory' for your own)"
        )
    return _checked(f"{where}.kwargs", kwargs, MODEL_ARGUMENTS[name])


def check_dataset(name: object, kwargs: object, *, where: str = "dataset") -> dict[str, Any]:
    """The complete keyword arguments of built-in dataset `name`, as `check_model` does."""
    if not isinstance(name, str) or name not in DATASET_ARGUMENTS:
        raise ModelError(
            f"{where}.name: {name!r} is not a built-in dataset; allowed: {', '.join(DATASETS)}"
        )
    return _checked(f"{where}.kwargs", kwargs, DATASET_ARGUMENTS[name])


def check_module(module: object, *, where: str = "model.module") -> tuple[str, str]:
    """(module, factory path) of a user model's ``"package.module:factory"``; the form only:
    whether it imports is known where the model is built."""
    if not isinstance(module, str) or not _MODULE_FORM.match(module):
        raise ModelError(
            f"{where}: {module!r} is malformed; expected 'package.module:factory', "
            "importable from PYTHONPATH"
        )
    module_name, factory_path = module.split(":")
    return module_name, factory_path


# --- optimizers -------------------------------------------------------------------------------

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


BOUNDS: Mapping[str, Bounds] = {
    "learning_rate": Bounds(above=0),
    **dict.fromkeys(("b1", "b2", "b3"), Bounds(minimum=0, below=1)),
    **dict.fromkeys(("decay", "rho", "momentum"), Bounds(minimum=0, maximum=1)),
    **dict.fromkeys(
        (
            "eps",
            "eps_root",
            "weight_decay",
            "weight_decay_rate",
            "initial_accumulator_value",
            "initial_scale",
            "min_norm",
            "trust_coefficient",
            "eta",
            "gamma",
            "min_step_size",
            "max_step_size",
            "min_dim_size_to_factor",
            "seed",
        ),
        Bounds(minimum=0),
    ),
    "memory_size": Bounds(minimum=1),
}
"""The range of a numeric optax parameter, by name (optax's signatures give types, not ranges):
what makes sense for every optimizer that has the name. A parameter not named here may be any
finite number (or integer). `installed_optimizers` records these in the table and refuses a
range that excludes optax's own default."""

NOT_JSON: Mapping[str, str] = {"key": "a JAX PRNG key (give seed instead)"}
"""Parameters whose annotation admits numbers but whose meaning JSON cannot carry."""


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
    return MappingProxyType(_table_from_json(OPTIMIZER_TABLE.read_text()))


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


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of a Union annotation (`X | Y`, `Optional[X]`), or the annotation alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_callable(member: Any) -> bool:
    return member is abc.Callable or typing.get_origin(member) is abc.Callable


def _takes(name: str, members: Sequence[Any]) -> str:
    """What optax takes in a parameter JSON cannot give, in words."""
    if name in NOT_JSON:
        return NOT_JSON[name]
    if "mask" in name:
        return "a mask (a pytree of booleans, or a callable that makes one)"
    if "dtype" in name:
        return "a dtype"
    if any("GradientTransformation" in str(m) for m in members):
        return "an optax transformation"
    if any(_is_callable(m) for m in members):
        return "a callable"
    return "a Python object"


def parameter(optimizer: str, p: inspect.Parameter) -> Parameter:
    """What a manifest may give `p` of optax.`optimizer`, from its annotation and default, and
    its range from `BOUNDS`."""
    members = _members(p.annotation)
    rest = [m for m in members if m is not type(None)]
    nullable = type(None) in members or p.default is None
    if p.name not in NOT_JSON and rest in ([bool], [int]):
        kind = BOOLEAN if rest == [bool] else INTEGER
    elif p.name not in NOT_JSON and (int in rest or float in rest):
        kind = NUMBER
    else:
        json_default = p.default is None or isinstance(p.default, bool)
        return Parameter(
            kind=FIXED,
            takes=_takes(p.name, rest),
            allowed=(p.default,) if json_default else (),
        )
    described = Parameter(
        kind=kind,
        nullable=nullable,
        bounds=BOUNDS.get(p.name, Bounds()) if kind != BOOLEAN else Bounds(),
        schedule=kind == NUMBER and any(_is_callable(m) for m in rest),
    )
    if p.default is not p.empty and described.problem("", p.default, optimizer=optimizer):
        raise OptimizerError(
            f"optax.{optimizer}: its default {p.name}={p.default!r} is outside "
            f"{described.bounds}: correct catalog.BOUNDS[{p.name!r}]"
        )
    return described


def installed_optimizers() -> dict[str, Optimizer]:
    """The table as the installed optax has it: every public function with a `learning_rate`
    parameter, each parameter described by `parameter`. Imports optax (for --write and
    --check only)."""
    import optax  # noqa: PLC0415 - the rest of this module must import without optax

    table = {}
    for name in sorted(dir(optax)):
        function = getattr(optax, name)
        if name.startswith("_") or not inspect.isfunction(function):
            continue
        parameters = inspect.signature(function, eval_str=True).parameters.values()
        if "learning_rate" not in {p.name for p in parameters}:
            continue
        odd = [
            p.name for p in parameters if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if odd:
            raise OptimizerError(
                f"optax.{name}: parameters {', '.join(odd)} cannot be given by keyword; the "
                "optimizer table describes keyword parameters only"
            )
        table[name] = Optimizer(
            parameters={p.name: parameter(name, p) for p in parameters},
            required=tuple(p.name for p in parameters if p.default is p.empty),
        )
    return table


def table_json(table: Mapping[str, Optimizer]) -> str:
    """The text of `OPTIMIZER_TABLE` for `table`: one parameter a line, sorted by optimizer."""
    blocks = []
    for name, optimizer in sorted(table.items()):
        rows = ",\n".join(
            f"        {json.dumps(key)}: {json.dumps(p.to_json())}"
            for key, p in optimizer.parameters.items()
        )
        blocks.append(
            f"    {json.dumps(name)}: {{\n"
            f'      "required": {json.dumps(list(optimizer.required))},\n'
            f'      "parameters": {{\n{rows}\n      }}\n    }}'
        )
    comment = (
        "Generated from the installed optax (signatures) and catalog.BOUNDS (ranges) by "
        "`python -m jaxps_runtime.config --write`; `--check` (make verify) fails when it "
        "drifts. Do not edit."
    )
    body = ",\n".join(blocks)
    return f'{{\n  "comment": {json.dumps(comment)},\n  "optimizers": {{\n{body}\n  }}\n}}\n'


def _table_from_json(text: str) -> dict[str, Optimizer]:
    raw = json.loads(text)["optimizers"]
    return {
        name: Optimizer(
            parameters={k: Parameter.from_json(p) for k, p in entry["parameters"].items()},
            required=tuple(entry["required"]),
        )
        for name, entry in sorted(raw.items())
    }


def drift(table: Mapping[str, Optimizer], installed: Mapping[str, Optimizer]) -> list[str]:
    """How `table` differs from `installed`, one line per optimizer or parameter; [] when they
    agree."""
    lines = []
    for name in sorted(set(table) | set(installed)):
        if name not in table:
            lines.append(f"optax.{name}: in the installed optax, not in the table")
        elif name not in installed:
            lines.append(f"optax.{name}: in the table, not in the installed optax")
        elif (list(table[name].parameters), table[name].required) != (
            list(installed[name].parameters),
            installed[name].required,
        ):
            was, now = table[name], installed[name]
            lines.append(
                f"optax.{name}: the table has parameters {list(was.parameters)} (required "
                f"{list(was.required)}), optax has {list(now.parameters)} (required "
                f"{list(now.required)})"
            )
        else:
            lines += [
                f"optax.{name}({key}): the table has {json.dumps(was.to_json())}, optax and "
                f"catalog.BOUNDS give {json.dumps(now.to_json())}"
                for (key, was), now in zip(
                    table[name].parameters.items(), installed[name].parameters.values(), strict=True
                )
                if was != now
            ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxps_runtime.config",
        description="Writes or checks the optimizer table against the installed optax.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="regenerate the table")
    action.add_argument("--check", action="store_true", help="exit 1 if the table drifted")
    parser.add_argument(
        "--table", type=Path, default=OPTIMIZER_TABLE, help="the table (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    file: Path = args.table
    expected = table_json(installed_optimizers())
    if args.write:
        file.write_text(expected)
        print(f"wrote {file}")
        return 0
    try:
        text = file.read_text()
        lines = drift(_table_from_json(text), _table_from_json(expected))
    except (OSError, ValueError, KeyError, TypeError) as err:
        text, lines = "", [f"cannot read it ({type(err).__name__}: {err})"]
    if text == expected:
        print(f"{file.name} matches the installed optax")
        return 0
    print(f"{file} drifted from the installed optax:", file=sys.stderr)
    for line in lines or ["same optimizers, other formatting"]:
        print(f"  {line}", file=sys.stderr)
    print("run `python -m jaxps_runtime.config --write` and commit the table", file=sys.stderr)
    return 1
