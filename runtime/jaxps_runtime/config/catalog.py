"""What jaxps has built in, by name: models, datasets, placement strategies, optax optimizers;
and the optimizer table's making.

Standard library only (an import-linter contract keeps it so): the operator checks a
TrainingJob's `spec.training` with this module where JAX, optax and numpy are not installed, and
the runtime checks the same things with the same code (`config`, `models`), so a job is refused
with the same words before it starts as at its start. Callers name everything through here:

* Models and datasets (`arguments`): their names, the dataset each model trains on by default,
  and each built-in's keyword arguments with their defaults and checks (`check_model`,
  `check_dataset`, raising `ModelError` naming the field, the value and what is allowed).
* Optimizers (`optimizer_table`): every optax function that takes a `learning_rate`, what a
  manifest may give each parameter, read from `optimizers.json`; `check_optimizer` is the one
  check of a job's optimizer.
* The table's making, here: it is generated from the installed optax (`parameter`: a type from
  optax's annotation, a range from `BOUNDS` by name): `python -m jaxps_runtime.config --write`
  writes it and `--check` (in `make verify`) exits 1 naming what drifted. Only those two read
  optax, inside the function that does it.

Pure and thread-safe; the optimizer table is read once.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
import typing
from collections import abc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxps_runtime.config.arguments import (
    DATASET_ARGUMENTS,
    DATASETS,
    DEFAULT_DATASET,
    DEFAULT_MIN_SHARD_BYTES,
    FILE_DATASETS,
    GREEDY,
    MODEL_ARGUMENTS,
    MODELS,
    ROUND_ROBIN,
    STRATEGIES,
    Argument,
    ModelError,
    batch_keys,
    check_dataset,
    check_model,
    check_module,
    count,
    fraction,
    optional_count,
    optional_path,
    options,
    path,
    widths,
)
from jaxps_runtime.config.optimizer_table import (
    BOOLEAN,
    FIXED,
    INTEGER,
    NUMBER,
    OPTIMIZER_TABLE,
    Bounds,
    Optimizer,
    OptimizerError,
    Parameter,
    check_optimizer,
    optimizers,
    table_from_json,
)

__all__ = [
    "BOOLEAN",
    "BOUNDS",
    "DATASETS",
    "DATASET_ARGUMENTS",
    "DEFAULT_DATASET",
    "DEFAULT_MIN_SHARD_BYTES",
    "FILE_DATASETS",
    "FIXED",
    "GREEDY",
    "INTEGER",
    "MODELS",
    "MODEL_ARGUMENTS",
    "NOT_JSON",
    "NUMBER",
    "OPTIMIZER_TABLE",
    "ROUND_ROBIN",
    "STRATEGIES",
    "Argument",
    "Bounds",
    "ModelError",
    "Optimizer",
    "OptimizerError",
    "Parameter",
    "batch_keys",
    "check_dataset",
    "check_model",
    "check_module",
    "check_optimizer",
    "count",
    "drift",
    "fraction",
    "installed_optimizers",
    "main",
    "optimizers",
    "optional_count",
    "optional_path",
    "options",
    "parameter",
    "path",
    "table_json",
    "widths",
]

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
        lines = drift(table_from_json(text), table_from_json(expected))
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
