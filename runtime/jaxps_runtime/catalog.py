"""What jaxps has built in, by name: models, datasets, placement strategies, optax optimizers.

Standard library only (an import-linter contract keeps it so): the operator checks a
TrainingJob's `spec.training` with this module where JAX, optax and numpy are not installed, and
the runtime checks the same things with the same code (`config`, `models`), so a job is refused
with the same words before it starts as at its start.

* Models and datasets: their names, the dataset each model trains on by default, and each
  built-in's keyword arguments (manifest spelling) with their defaults and checks.
  `check_model` / `check_dataset` return the complete, checked keyword arguments or raise
  `ModelError`, whose message names the field, the value and what is allowed.
* Optimizers: every optax function that takes a `learning_rate`, with its parameter names and
  which of them are required, read from `optimizers.json` next to this file. That table is
  generated from the installed optax: `python -m jaxps_runtime.catalog --write` rewrites it and
  `--check` (in `make verify`) exits 1 naming what drifted. Only those two read optax, inside
  the function that does it.

Pure and thread-safe; the optimizer table is read once.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import re
import sys
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
    """The optimizer configuration names no optax optimizer or passes it bad arguments."""


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
    # the user's files (jaxps_runtime.filedata)
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
FILE_DATASETS: tuple[str, ...] = ("arrays", "parquet", "idx")  # read by jaxps_runtime.filedata
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


class Optimizer(NamedTuple):
    """An optax optimizer's keyword parameters, in signature order, and the required ones."""

    parameters: tuple[str, ...]
    required: tuple[str, ...]


@functools.cache
def optimizers() -> Mapping[str, Optimizer]:
    """Every optax optimizer a job may name, by name (sorted), from `OPTIMIZER_TABLE`."""
    return MappingProxyType(_table_from_json(OPTIMIZER_TABLE.read_text()))


def check_optimizer(name: object, kwargs: Mapping[str, Any], *, where: str = "optimizer") -> str:
    """`name`, once known to be an optimizer of the table that takes every argument in `kwargs`
    and finds its required ones there. The values are optax's to judge: `optim.build` does, at
    task start."""
    table = optimizers()
    if not isinstance(name, str) or name not in table:
        raise OptimizerError(
            f"{where}.name: got {json.dumps(name, default=str)}; expected one of {', '.join(table)}"
        )
    optimizer = table[name]
    for key in kwargs:
        if key not in optimizer.parameters:
            raise OptimizerError(
                f"{where}.kwargs.{key}: optax.{name} has no argument {key!r}; "
                f"allowed: {', '.join(optimizer.parameters)}"
            )
    for key in optimizer.required:
        if key not in kwargs:
            raise OptimizerError(
                f"{where}.kwargs.{key}: missing; optax.{name} requires "
                f"{', '.join(optimizer.required)}"
            )
    return name


def installed_optimizers() -> dict[str, Optimizer]:
    """The table as the installed optax has it: every public function with a `learning_rate`
    parameter. Imports optax (for --write and --check only)."""
    import optax  # noqa: PLC0415 - the rest of this module must import without optax

    table = {}
    for name in sorted(dir(optax)):
        function = getattr(optax, name)
        if name.startswith("_") or not inspect.isfunction(function):
            continue
        parameters = inspect.signature(function).parameters.values()
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
            parameters=tuple(p.name for p in parameters),
            required=tuple(p.name for p in parameters if p.default is p.empty),
        )
    return table


def table_json(table: Mapping[str, Optimizer]) -> str:
    """The text of `OPTIMIZER_TABLE` for `table`: one optimizer a line, sorted by name."""
    rows = [
        f"    {json.dumps(name)}: "
        + json.dumps({"parameters": list(o.parameters), "required": list(o.required)})
        for name, o in sorted(table.items())
    ]
    comment = (
        "Generated from the installed optax by `python -m jaxps_runtime.catalog --write`; "
        "`--check` (make verify) fails when it drifts. Do not edit."
    )
    body = ",\n".join(rows)
    return f'{{\n  "comment": {json.dumps(comment)},\n  "optimizers": {{\n{body}\n  }}\n}}\n'


def _table_from_json(text: str) -> dict[str, Optimizer]:
    raw = json.loads(text)["optimizers"]
    return {
        name: Optimizer(parameters=tuple(entry["parameters"]), required=tuple(entry["required"]))
        for name, entry in sorted(raw.items())
    }


def drift(table: Mapping[str, Optimizer], installed: Mapping[str, Optimizer]) -> list[str]:
    """How `table` differs from `installed`, one line per optimizer; [] when they agree."""
    lines = []
    for name in sorted(set(table) | set(installed)):
        if name not in table:
            lines.append(f"optax.{name}: in the installed optax, not in the table")
        elif name not in installed:
            lines.append(f"optax.{name}: in the table, not in the installed optax")
        elif table[name] != installed[name]:
            was, now = table[name], installed[name]
            lines.append(
                f"optax.{name}: the table has parameters {list(was.parameters)} (required "
                f"{list(was.required)}), optax has {list(now.parameters)} (required "
                f"{list(now.required)})"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxps_runtime.catalog",
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
    print("run `python -m jaxps_runtime.catalog --write` and commit the table", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
