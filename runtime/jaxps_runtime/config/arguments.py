"""The built-in models and datasets by name, with their keyword arguments (manifest spelling),
their defaults and checks, and the placement strategies.

`check_model` / `check_dataset` return the complete, checked keyword arguments or raise
`ModelError`, whose message names the field, the value and what is allowed. Standard library
only (the operator checks a manifest with it where JAX is not installed); pure and thread-safe.
Callers name these through `catalog`, which holds the optimizers too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

GREEDY = "greedy"
ROUND_ROBIN = "roundRobin"
STRATEGIES = (GREEDY, ROUND_ROBIN)
DEFAULT_MIN_SHARD_BYTES = 256 << 10  # TensorFlow's MinSizePartitioner default

_MODULE_FORM = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class ModelError(ValueError):
    """Bad model or dataset configuration; the message names the field, the value and what is
    allowed."""


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
