"""The sections of `spec.training`: model, dataset, optimizer, placement, checkpoint and
tensorboard, each a frozen dataclass whose fields are the manifest's (with their defaults and
rules, `reader.setting`), and the function that reads it from a manifest's object.

Every `OptimizerConfig` that config or a ps reads (`from_dict`, `from_json`) is checked against
the optimizer table (`catalog.check_optimizer`), the only copy of those rules: what holds one
(`optim.build`) does not check it again, and only the installed optax may refuse more.

Standard library only; pure and thread-safe.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxps_runtime.config import catalog
from jaxps_runtime.config.reader import Reader, TrainingConfigError, fail, setting, specs


@dataclass(frozen=True)
class OptimizerConfig:
    """An optax optimizer by function name, with its keyword arguments (JSON values).

    `from_dict` and `from_json` check the name, the argument names and each value's type and
    range against `catalog.optimizers()` (a `learning_rate` of "0.01" is refused here, not at
    the first update): a job's configuration and a ps's Init (an edge: the optimizer comes as
    JSON over gRPC) both read it so. Built directly, it is taken as given (tests, defaults)."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str, *, where: str = "optimizer") -> OptimizerConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise catalog.OptimizerError(f"{where}: not JSON ({err})") from err
        return cls.from_dict(raw, where=where)

    @classmethod
    def from_dict(cls, raw: object, *, where: str = "optimizer") -> OptimizerConfig:
        if not isinstance(raw, Mapping):
            raise catalog.OptimizerError(
                f"{where}: expected an object {{name, kwargs}}, got {raw!r}"
            )
        unknown = sorted(set(raw) - {"name", "kwargs"})
        if unknown:
            raise catalog.OptimizerError(
                f"{where}: unknown key {unknown[0]!r}; allowed: name, kwargs"
            )
        name, kwargs = raw.get("name"), raw.get("kwargs", {})
        if not isinstance(kwargs, Mapping):
            raise catalog.OptimizerError(f"{where}.kwargs: expected an object, got {kwargs!r}")
        return cls(name=catalog.check_optimizer(name, kwargs, where=where), kwargs=dict(kwargs))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": dict(self.kwargs)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def default_optimizer() -> OptimizerConfig:
    return OptimizerConfig("adagrad", {"learning_rate": 0.1})


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"
    module: str | None = None  # "pkg.mod:factory" for a user model
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetConfig:
    # The default is the model's (`catalog.DEFAULT_DATASET`); any name with a module.
    name: str = setting("digits", allowed=catalog.DATASETS, static_default=False)
    module: str | None = None  # "pkg.mod:factory" for a user dataset
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementConfig:
    strategy: str = setting(catalog.GREEDY, allowed=catalog.STRATEGIES)
    minShardBytes: int = setting(catalog.DEFAULT_MIN_SHARD_BYTES, minimum=1)  # noqa: N815


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    everySteps: int | None = setting(None, minimum=1)  # noqa: N815 - manifest spelling
    everySeconds: float | None = setting(None, minimum=1)  # noqa: N815
    keep: int = setting(3, minimum=1)
    claimName: str | None = None  # noqa: N815


@dataclass(frozen=True)
class TensorBoardConfig:
    """`training.tensorboard`: where the chief (`<dir>/train`) and the evaluator (`<dir>/eval`)
    write TensorBoard event files, and how often at most their writes wait in memory. No field,
    no event files (`jaxps local` gives one; Kubernetes does not)."""

    dir: str
    flushSeconds: int = setting(5, minimum=1)  # noqa: N815


DEFAULT_FLUSH_SECONDS: int = specs(TensorBoardConfig)["flushSeconds"].default


def read_plain(raw: object, path: str, schema: Any) -> Any:
    """A section of `schema` whose every field is read by its rules alone, in field order."""
    reader = Reader(raw, path, schema)
    values = {key: reader.setting(key) for key in specs(schema)}
    reader.done()
    return schema(**values)


def read_model(raw: object, path: str) -> ModelConfig:
    reader = Reader(raw, path, ModelConfig)
    model = ModelConfig(
        name=reader.setting("name"),
        module=reader.setting("module"),
        kwargs=reader.mapping("kwargs"),
    )
    reader.done()
    if model.module is not None:
        catalog.check_module(model.module, where=f"{path}.module")
    elif model.name not in catalog.MODELS:
        raise fail(
            f"{path}.name", model.name, f"one of {', '.join(catalog.MODELS)} (or set model.module)"
        )
    else:
        catalog.check_model(model.name, model.kwargs, where=path)
    return model


def default_dataset(raw_model: object) -> str:
    """The dataset of the model `raw_model` names (read as given, even when it is invalid)."""
    name = raw_model.get("name", "mlp") if isinstance(raw_model, Mapping) else "mlp"
    return catalog.DEFAULT_DATASET.get(name, "synthetic") if isinstance(name, str) else "synthetic"


def read_dataset(raw: object, path: str, *, default: str) -> DatasetConfig:
    reader = Reader(raw, path, DatasetConfig)
    module = reader.setting("module")
    dataset = DatasetConfig(
        name=(
            reader.string("name", "user")
            if module is not None
            else reader.string("name", default, allowed=catalog.DATASETS)
        )
        or default,
        module=module,
        kwargs=reader.mapping("kwargs"),
    )
    reader.done()
    if module is not None:  # its kwargs are the factory's: checked where it is called
        catalog.check_module(module, where=f"{path}.module")
    else:
        catalog.check_dataset(dataset.name, dataset.kwargs, where=path)
    return dataset


def read_optimizer(top: Reader) -> OptimizerConfig:
    if "optimizer" not in top.raw:
        return default_optimizer()
    return OptimizerConfig.from_dict(top.get("optimizer"), where=f"{top.path}.optimizer")


def read_tensorboard(raw: object, path: str) -> TensorBoardConfig | None:
    if raw is None:  # absent, or null as `to_json` writes it: no event files
        return None
    reader = Reader(raw, path, TensorBoardConfig)
    reader.done()  # first: `directory: /tb` is a misspelt dir, not a missing one
    if reader.get("dir") is None:
        raise TrainingConfigError(
            f"{path}.dir: missing; expected a non-empty string, the directory of the event files"
        )
    return TensorBoardConfig(dir=reader.setting("dir"), flushSeconds=reader.setting("flushSeconds"))
