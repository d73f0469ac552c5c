"""The training configuration: `spec.training` of a TrainingJob, as one typed object.

Parsed from JAXPS_TRAINING (JSON) or a `--training` JSON/YAML file. Keys are camelCase as in
the manifest; every default is applied here; every error names the field path, the value and
what is allowed (`training.steps: got 0; expected an integer >= 1`). Pure and thread-safe.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxps_runtime import optim, placement

MODES = ("sync", "async", "boundedStaleness")


class TrainingConfigError(ValueError):
    """The training configuration is invalid; the message names the field."""


def _fail(path: str, value: object, expected: str) -> TrainingConfigError:
    return TrainingConfigError(f"{path}: got {json.dumps(value, default=str)}; expected {expected}")


class _Reader:
    """Reads one object's keys, refusing unknown ones, with paths in every error."""

    def __init__(self, raw: object, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise _fail(path, raw, "an object")
        self.raw, self.path, self.seen = raw, path, set[str]()

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return self.raw.get(key, default)

    def integer(self, key: str, default: int | None, *, minimum: int) -> int | None:
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _fail(f"{self.path}.{key}", value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: float, *, minimum: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(f"{self.path}.{key}", value, f"a number >= {minimum}")
        if not math.isfinite(value) or value < minimum:
            raise _fail(f"{self.path}.{key}", value, f"a number >= {minimum}")
        return float(value)

    def string(self, key: str, default: str | None, *, allowed: tuple[str, ...] = ()) -> str | None:
        value = self.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value or (allowed and value not in allowed):
            what = f"one of {', '.join(allowed)}" if allowed else "a non-empty string"
            raise _fail(f"{self.path}.{key}", value, what)
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self.get(key, {})
        if not isinstance(value, Mapping):
            raise _fail(f"{self.path}.{key}", value, "an object")
        return dict(value)

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self.seen)
        if unknown:
            raise TrainingConfigError(
                f"{self.path}.{unknown[0]}: unknown field; allowed: {', '.join(sorted(self.seen))}"
            )


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"
    module: str | None = None  # "pkg.mod:factory" for a user model
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "digits"
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementConfig:
    strategy: str = placement.GREEDY
    minShardBytes: int = placement.DEFAULT_MIN_SHARD_BYTES  # noqa: N815 - manifest spelling


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    everySteps: int | None = None  # noqa: N815
    everySeconds: float | None = None  # noqa: N815
    keep: int = 3
    claimName: str | None = None  # noqa: N815


@dataclass(frozen=True)
class TrainingConfig:
    """`spec.training` with defaults applied. Field names are the manifest's."""

    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    mode: str = "async"
    replicasToAggregate: int | None = None  # noqa: N815 - sync only; default: live workers
    maxStaleness: int | None = None  # noqa: N815 - boundedStaleness only; default 2
    steps: int = 1000
    batchSize: int = 32  # noqa: N815
    seed: int = 0
    optimizer: optim.OptimizerConfig = field(
        default_factory=lambda: optim.OptimizerConfig("adagrad", {"learning_rate": 0.1})
    )
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evalEverySteps: int = 100  # noqa: N815
    logEverySeconds: float = 5.0  # noqa: N815
    heartbeatSeconds: float = 1.0  # noqa: N815
    workerTimeoutSeconds: float = 30.0  # noqa: N815
    startupTimeoutSeconds: float = 300.0  # noqa: N815
    exportPath: str | None = None  # noqa: N815 - the chief writes the final parameters here

    @property
    def staleness(self) -> int:
        return 2 if self.maxStaleness is None else self.maxStaleness

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["optimizer"] = {"name": self.optimizer.name, "kwargs": dict(self.optimizer.kwargs)}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def parse(raw: object, *, path: str = "training") -> TrainingConfig:
    """Validates `raw` (the parsed JSON/YAML object) and applies the defaults."""
    top = _Reader(raw, path)
    model_raw = _Reader(top.get("model"), f"{path}.model")
    model = ModelConfig(
        name=model_raw.string("name", "mlp") or "mlp",
        module=model_raw.string("module", None),
        kwargs=model_raw.mapping("kwargs"),
    )
    model_raw.done()
    from jaxps_runtime import models  # noqa: PLC0415 - keeps the config light to import

    default_dataset = models.DEFAULT_DATASET.get(model.name, "synthetic")
    data_raw = _Reader(top.get("dataset"), f"{path}.dataset")
    dataset = DatasetConfig(
        name=data_raw.string("name", default_dataset, allowed=models.DATASETS) or default_dataset,
        kwargs=data_raw.mapping("kwargs"),
    )
    data_raw.done()
    if model.module is None and model.name not in models.MODELS:
        raise _fail(
            f"{path}.model.name",
            model.name,
            f"one of {', '.join(models.MODELS)} (or set model.module)",
        )

    mode = top.string("mode", "async", allowed=MODES) or "async"
    replicas = top.integer("replicasToAggregate", None, minimum=1)
    staleness = top.integer("maxStaleness", None, minimum=0)
    if replicas is not None and mode != "sync":
        raise _fail(
            f"{path}.replicasToAggregate",
            replicas,
            f"no value unless mode is sync (mode is {mode})",
        )
    if staleness is not None and mode != "boundedStaleness":
        raise _fail(
            f"{path}.maxStaleness",
            staleness,
            f"no value unless mode is boundedStaleness (mode is {mode})",
        )

    try:
        optimizer = optim.OptimizerConfig.from_dict(
            top.get("optimizer", {"name": "adagrad", "kwargs": {"learning_rate": 0.1}}),
            where=f"{path}.optimizer",
        )
    except optim.OptimizerError as err:
        raise TrainingConfigError(str(err)) from err

    place_raw = _Reader(top.get("placement"), f"{path}.placement")
    place = PlacementConfig(
        strategy=place_raw.string("strategy", placement.GREEDY, allowed=placement.STRATEGIES)
        or placement.GREEDY,
        minShardBytes=place_raw.integer(
            "minShardBytes", placement.DEFAULT_MIN_SHARD_BYTES, minimum=1
        )
        or placement.DEFAULT_MIN_SHARD_BYTES,
    )
    place_raw.done()

    ckpt_raw = _Reader(top.get("checkpoint"), f"{path}.checkpoint")
    every_seconds = ckpt_raw.get("everySeconds")
    checkpoint = CheckpointConfig(
        dir=ckpt_raw.string("dir", None),
        everySteps=ckpt_raw.integer("everySteps", None, minimum=1),
        everySeconds=None
        if every_seconds is None
        else ckpt_raw.number("everySeconds", 0.0, minimum=1.0),
        keep=ckpt_raw.integer("keep", 3, minimum=1) or 3,
        claimName=ckpt_raw.string("claimName", None),
    )
    ckpt_raw.done()

    config = TrainingConfig(
        model=model,
        dataset=dataset,
        mode=mode,
        replicasToAggregate=replicas,
        maxStaleness=staleness,
        steps=top.integer("steps", 1000, minimum=1) or 1000,
        batchSize=top.integer("batchSize", 32, minimum=1) or 32,
        seed=top.integer("seed", 0, minimum=0) or 0,
        optimizer=optimizer,
        placement=place,
        checkpoint=checkpoint,
        evalEverySteps=top.integer("evalEverySteps", 100, minimum=1) or 100,
        logEverySeconds=top.number("logEverySeconds", 5.0, minimum=0.1),
        heartbeatSeconds=top.number("heartbeatSeconds", 1.0, minimum=0.05),
        workerTimeoutSeconds=top.number("workerTimeoutSeconds", 30.0, minimum=0.5),
        startupTimeoutSeconds=top.number("startupTimeoutSeconds", 300.0, minimum=1.0),
        exportPath=top.string("exportPath", None),
    )
    top.done()
    if config.workerTimeoutSeconds <= config.heartbeatSeconds:
        raise _fail(
            f"{path}.workerTimeoutSeconds",
            config.workerTimeoutSeconds,
            f"more than heartbeatSeconds ({config.heartbeatSeconds})",
        )
    return config


def loads(text: str, *, path: str = "training") -> TrainingConfig:
    """Parses JSON or YAML text (JSON is YAML)."""
    try:
        raw = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as err:
        raise TrainingConfigError(f"{path}: not JSON or YAML ({err})") from err
    return parse(raw, path=path)


def load(file: Path) -> TrainingConfig:
    try:
        text = file.read_text()
    except OSError as err:
        raise TrainingConfigError(f"--training {file}: cannot read it ({err.strerror})") from err
    return loads(text, path="training")
