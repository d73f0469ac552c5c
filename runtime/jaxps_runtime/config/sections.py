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
from jaxps_runtime.config.reader import Reader, TrainingConfigError, fail, line, setting, specs


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


EVICTIONS = ("lru", "lfu")


@dataclass(frozen=True)
class AdmissionConfig:
    """`embeddings.<table>.admission`: when an id not yet in the table gets a row. `minCount`:
    the occurrences (over every batch applied) an id needs first; `probability`: the chance,
    drawn as a function of (id, count), that an id reaching `minCount` is admitted then (below
    1, an id keeps being drawn as it is seen again). Until admitted, an id reads its initial
    value and its gradients are dropped."""

    minCount: int = setting(1, minimum=1)  # noqa: N815 - manifest spelling
    probability: float = setting(1.0, minimum=0)


@dataclass(frozen=True)
class InitializerConfig:
    """`embeddings.<table>.initializer`: a new row's value, uniform in [-scale, scale), a
    function of (training.seed, table, id) alone: every task reads the same vector for an id
    until its first update."""

    scale: float = setting(0.05, minimum=0)


@dataclass(frozen=True)
class EmbeddingConfig:
    """`embeddings.<table>`: a dynamic embedding table keyed by any 64-bit id (the model's
    `sparse` table of that name), bounded to `maxRows` resident rows over the job's ps."""

    dim: int = setting(minimum=1)
    maxRows: int = setting(minimum=1)  # noqa: N815 - manifest spelling
    eviction: str = setting("lru", allowed=EVICTIONS)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    initializer: InitializerConfig = field(default_factory=InitializerConfig)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "maxRows": self.maxRows,
            "eviction": self.eviction,
            "admission": {
                "minCount": self.admission.minCount,
                "probability": self.admission.probability,
            },
            "initializer": {"scale": self.initializer.scale},
        }


def read_embeddings(raw: object, path: str) -> dict[str, EmbeddingConfig]:
    """`training.embeddings`: {table: EmbeddingConfig}; every problem of every table named."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise fail(path, raw, "an object of tables: {<table>: {dim, maxRows, ...}}")
    out: dict[str, EmbeddingConfig] = {}
    found: list[str] = []
    for table, node in raw.items():
        where = f"{path}.{table}"
        try:
            reader = Reader(node, where, EmbeddingConfig)
            reader.done()
        except TrainingConfigError as err:
            found += err.problems
            continue
        values: dict[str, Any] = {}
        for key in ("dim", "maxRows", "eviction"):
            try:
                if key != "eviction" and reader.get(key) is None:
                    raise TrainingConfigError(f"{where}.{key}: missing; expected an integer >= 1")
                values[key] = reader.setting(key)
            except TrainingConfigError as err:
                found += err.problems
        for key, section in (("admission", AdmissionConfig), ("initializer", InitializerConfig)):
            try:
                values[key] = read_plain(reader.get(key), f"{where}.{key}", section)
            except TrainingConfigError as err:
                found += err.problems
        admission = values.get("admission")
        if admission is not None and not 0 < admission.probability <= 1:
            found.append(line(f"{where}.admission.probability", admission.probability, "in (0, 1]"))
        if len(values) == 5:
            out[str(table)] = EmbeddingConfig(**values)
    if found:
        raise TrainingConfigError(found[0], problems=found)
    return out
