"""The user's factory, ``"package.module:factory"``: imported and called with its keyword
arguments, every error naming the manifest field (`model.module`, `dataset.kwargs`, ...)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxps_runtime.config import catalog

ModelError = catalog.ModelError


def find(module: str, *, field: str) -> Callable[..., Any]:
    """The callable ``module = "package.module:name"`` names, imported; errors name `field`."""
    expected = "expected 'package.module:factory', importable from PYTHONPATH"
    module_name, factory_path = catalog.check_module(module, where=field)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        raise ModelError(
            f"{field}: {module!r}: cannot import {module_name!r} "
            f"({type(err).__name__}: {err}); {expected}"
        ) from err
    for attr in factory_path.split("."):
        if not hasattr(obj, attr):
            raise ModelError(
                f"{field}: {module!r}: {module_name!r} has no attribute {factory_path!r}; "
                f"{expected}"
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ModelError(f"{field}: {module!r}: {factory_path!r} is not callable; {expected}")
    found: Callable[..., Any] = obj
    return found


def from_factory(module: str, kwargs: Mapping[str, Any] | None, *, field: str) -> Any:
    """``factory(**kwargs)`` of ``module = "package.module:factory"``; errors name
    `<field>.module` or `<field>.kwargs`."""
    factory = find(module, field=f"{field}.module")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ModelError(f"{field}.kwargs: expected an object of keyword arguments, got {kwargs!r}")
    try:
        return factory(**(kwargs or {}))
    except ModelError:
        raise
    except (TypeError, ValueError, OSError) as err:
        raise ModelError(f"{field}.kwargs: {module} refused them: {err}") from err
