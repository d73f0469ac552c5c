"""The training configuration: `spec.training` of a TrainingJob, as one typed object.

Parsed from JAXPS_TRAINING (JSON) or a `--training` JSON/YAML file. Keys are camelCase as in
the manifest; every default is applied here; every error names the field path, the value and
what is allowed (`training.steps: got 0; expected an integer >= 1`). Pure and thread-safe.

No JAX, optax or numpy (an import-linter contract and a unit test keep it so): the operator
checks a manifest with this module, and the runtime checks it again at start with the same code.
What only JAX can judge (a user model's import, what the installed optax refuses beyond the
types and ranges of `catalog`'s table) is checked at task start (`roles`); a task that finds
its configuration invalid there exits `EXIT_INVALID_TRAINING`. `parse` raises on the first
problem; `problems` lists them all, and so does the `problems` of the error `parse` raises.

Cross-field rules, each skipped when a field it compares was refused: a built-in model and a
built-in dataset must fit (`_fit_problems`: the batch key, the width, the labels, embedding
rows for every id), `onDivergence: rollback` needs `checkpoint.dir`; and with the job's tasks
(`Replicas`: a manifest's replicaSpecs, or a task's TF_CONFIG), `replica_problems`: at least
one ps, `replicasToAggregate` at most the workers, a built-in dataset's examples at least the
workers.

`tensorboard: {dir, flushSeconds}` (optional; no field, no event files): the chief writes its
training scalars under `dir/train` and the evaluator its metrics under `dir/eval`
(`summaries`); `dir` is required, a non-empty string; `flushSeconds`, an integer >= 1 (default
5), bounds how long an event waits in memory. `null` is the same as no field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import yaml

from jaxps_runtime.config import catalog

MODES = ("sync", "async", "boundedStaleness")
ON_DIVERGENCE = ("fail", "rollback")
EXIT_INVALID_TRAINING = 78
"""A task's exit code when its training configuration is invalid (sysexits' EX_CONFIG): the
control plane fails the job at once (reason InvalidTraining) and never retries it."""
EXIT_USER_CODE = 79
"""The user's model, dataset or evaluation raised: another pod would raise the same."""
EXIT_DIVERGED = 80
"""The loss, a gradient or an update is not finite (and no rollback is left to try)."""
EXIT_STALLED = 81
"""The global step has not moved for `progressTimeoutSeconds` while the job should train."""
FINAL_EXITS: Mapping[int, str] = {
    EXIT_INVALID_TRAINING: "InvalidTraining",
    EXIT_USER_CODE: "UserCodeError",
    EXIT_DIVERGED: "Diverged",
    EXIT_STALLED: "Stalled",
}
"""Exit codes that end the job at once, whatever the role's restart policy, with the reason
named here; the task's termination log (`termination`) holds the message. A replacement pod
would meet the same cause: retrying only hides it."""

T = TypeVar("T")


class TrainingConfigError(ValueError):
    """The training configuration is invalid. The message names the first problem's field;
    `problems` holds every independent problem found, one line each."""

    def __init__(self, message: str, *, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = tuple(problems) or (message,)


def _fail(path: str, value: object, expected: str) -> TrainingConfigError:
    return TrainingConfigError(f"{path}: got {json.dumps(value, default=str)}; expected {expected}")


class _Reader:
    """Reads one object's keys, with paths in every error; `done` refuses keys that are not
    fields of `schema` (a dataclass), whichever keys were read."""

    def __init__(self, raw: object, path: str, schema: type) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise _fail(path, raw, "an object")
        self.raw, self.path = raw, path
        self.allowed = sorted(f.name for f in fields(schema))

    def get(self, key: str, default: Any = None) -> Any:
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
        unknown = sorted(set(self.raw) - set(self.allowed))
        if unknown:
            raise TrainingConfigError(
                f"{self.path}.{unknown[0]}: unknown field; allowed: {', '.join(self.allowed)}"
            )


@dataclass(frozen=True)
class OptimizerConfig:
    """An optax optimizer by function name, with its keyword arguments (JSON values).

    `from_dict` checks the name, the argument names and each value's type and range against
    `catalog.optimizers()` (a `learning_rate` of "0.01" is refused here, not at the first
    update); what only the installed optax can judge, `optim.build` does at task start."""

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

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "kwargs": dict(self.kwargs)}, sort_keys=True)


def _default_optimizer() -> OptimizerConfig:
    return OptimizerConfig("adagrad", {"learning_rate": 0.1})


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"
    module: str | None = None  # "pkg.mod:factory" for a user model
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "digits"
    module: str | None = None  # "pkg.mod:factory" for a user dataset
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementConfig:
    strategy: str = catalog.GREEDY
    minShardBytes: int = catalog.DEFAULT_MIN_SHARD_BYTES  # noqa: N815 - manifest spelling


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    everySteps: int | None = None  # noqa: N815
    everySeconds: float | None = None  # noqa: N815
    keep: int = 3
    claimName: str | None = None  # noqa: N815


DEFAULT_FLUSH_SECONDS = 5


@dataclass(frozen=True)
class TensorBoardConfig:
    """`training.tensorboard`: where the chief (`<dir>/train`) and the evaluator (`<dir>/eval`)
    write TensorBoard event files, and how often at most their writes wait in memory. No field,
    no event files (`jaxps local` gives one; Kubernetes does not)."""

    dir: str
    flushSeconds: int = DEFAULT_FLUSH_SECONDS  # noqa: N815


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
    optimizer: OptimizerConfig = field(default_factory=_default_optimizer)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evalEverySteps: int = 100  # noqa: N815
    logEverySeconds: float = 5.0  # noqa: N815
    heartbeatSeconds: float = 1.0  # noqa: N815
    workerTimeoutSeconds: float = 30.0  # noqa: N815
    startupTimeoutSeconds: float = 300.0  # noqa: N815
    exportPath: str | None = None  # noqa: N815 - the chief writes the final parameters here
    tensorboard: TensorBoardConfig | None = None  # None: no event files
    # Stalled: the global step did not move for this long while training (0: never).
    progressTimeoutSeconds: float = 600.0  # noqa: N815
    onDivergence: str = "fail"  # noqa: N815 - or "rollback" to the last checkpoint
    maxRollbacks: int = 3  # noqa: N815 - rollbacks on divergence before the job fails
    summaryEverySteps: int = 10  # noqa: N815 - a TensorBoard training point every N steps

    @property
    def staleness(self) -> int:
        return 2 if self.maxStaleness is None else self.maxStaleness

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["optimizer"] = {"name": self.optimizer.name, "kwargs": dict(self.optimizer.kwargs)}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


class _Problems:
    """The problems of one configuration, section by section: a section that fails is recorded
    and stands in as its default, so that the sections after it are checked too."""

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


def _model(raw: object, path: str) -> ModelConfig:
    reader = _Reader(raw, path, ModelConfig)
    model = ModelConfig(
        name=reader.string("name", "mlp") or "mlp",
        module=reader.string("module", None),
        kwargs=reader.mapping("kwargs"),
    )
    reader.done()
    if model.module is not None:
        catalog.check_module(model.module, where=f"{path}.module")
    elif model.name not in catalog.MODELS:
        raise _fail(
            f"{path}.name", model.name, f"one of {', '.join(catalog.MODELS)} (or set model.module)"
        )
    else:
        catalog.check_model(model.name, model.kwargs, where=path)
    return model


def _default_dataset(raw_model: object) -> str:
    """The dataset of the model `raw_model` names (read as given, even when it is invalid)."""
    name = raw_model.get("name", "mlp") if isinstance(raw_model, Mapping) else "mlp"
    return catalog.DEFAULT_DATASET.get(name, "synthetic") if isinstance(name, str) else "synthetic"


def _dataset(raw: object, path: str, *, default: str) -> DatasetConfig:
    reader = _Reader(raw, path, DatasetConfig)
    module = reader.string("module", None)
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


def _mode(top: _Reader) -> tuple[str, int | None, int | None]:
    """(mode, replicasToAggregate, maxStaleness): each of the last two only in its mode."""
    mode = top.string("mode", "async", allowed=MODES) or "async"
    replicas = top.integer("replicasToAggregate", None, minimum=1)
    staleness = top.integer("maxStaleness", None, minimum=0)
    if replicas is not None and mode != "sync":
        raise _fail(
            f"{top.path}.replicasToAggregate",
            replicas,
            f"no value unless mode is sync (mode is {mode})",
        )
    if staleness is not None and mode != "boundedStaleness":
        raise _fail(
            f"{top.path}.maxStaleness",
            staleness,
            f"no value unless mode is boundedStaleness (mode is {mode})",
        )
    return mode, replicas, staleness


def _placement(raw: object, path: str) -> PlacementConfig:
    reader = _Reader(raw, path, PlacementConfig)
    place = PlacementConfig(
        strategy=reader.string("strategy", catalog.GREEDY, allowed=catalog.STRATEGIES)
        or catalog.GREEDY,
        minShardBytes=reader.integer("minShardBytes", catalog.DEFAULT_MIN_SHARD_BYTES, minimum=1)
        or catalog.DEFAULT_MIN_SHARD_BYTES,
    )
    reader.done()
    return place


def _checkpoint(raw: object, path: str) -> CheckpointConfig:
    reader = _Reader(raw, path, CheckpointConfig)
    every_seconds = reader.get("everySeconds")
    checkpoint = CheckpointConfig(
        dir=reader.string("dir", None),
        everySteps=reader.integer("everySteps", None, minimum=1),
        everySeconds=None
        if every_seconds is None
        else reader.number("everySeconds", 0.0, minimum=1.0),
        keep=reader.integer("keep", 3, minimum=1) or 3,
        claimName=reader.string("claimName", None),
    )
    reader.done()
    return checkpoint


def _tensorboard(raw: object, path: str) -> TensorBoardConfig | None:
    if raw is None:  # absent, or null as `to_json` writes it: no event files
        return None
    reader = _Reader(raw, path, TensorBoardConfig)
    reader.done()  # first: `directory: /tb` is a misspelt dir, not a missing one
    if reader.get("dir") is None:
        raise TrainingConfigError(
            f"{path}.dir: missing; expected a non-empty string, the directory of the event files"
        )
    return TensorBoardConfig(
        dir=reader.string("dir", None) or "",
        flushSeconds=reader.integer("flushSeconds", DEFAULT_FLUSH_SECONDS, minimum=1)
        or DEFAULT_FLUSH_SECONDS,
    )


# --- cross-field rules ------------------------------------------------------------------------

DIGITS_WIDTH, DIGITS_CLASSES = 64, 10  # scikit-learn's 8x8 digits, labels 0..9
_READS = {"linear": "x", "mlp": "x", "embedding": "ids"}  # the batch key a built-in model reads


def _fit_problems(model: ModelConfig, dataset: DatasetConfig, *, path: str) -> list[str]:
    """What a built-in model and a built-in dataset would refuse of each other at task start
    (a batch key or a width the model does not take, labels it cannot score) or hang on
    mid-job (ids beyond the embedding table), found from their arguments alone. A user
    module's batches and files are known only where they are read: not checked here."""
    if model.module is not None or dataset.module is not None:
        return []
    if dataset.name in catalog.FILE_DATASETS:
        return []
    m = catalog.check_model(model.name, model.kwargs)
    d = catalog.check_dataset(dataset.name, dataset.kwargs)
    mk, dk = f"{path}.model.kwargs", f"{path}.dataset.kwargs"
    reads, holds = _READS[model.name], "ids" if dataset.name == "sparse" else "x"
    if reads != holds:
        fitting = "sparse" if reads == "ids" else "synthetic, digits, idx"
        return [
            _line(
                f"{path}.dataset.name",
                dataset.name,
                f"{fitting} or your files for model {model.name}, which reads batch key "
                f"{reads!r} (the batches of {dataset.name} hold {holds!r} and 'y')",
            )
        ]
    found = []
    if model.name == "embedding":
        if m["rows"] < d["idRange"]:
            found.append(
                _line(
                    f"{mk}.rows",
                    m["rows"],
                    f"at least {dk}.idRange ({d['idRange']}): the dataset's ids run up to "
                    f"{d['idRange'] - 1} and each reads its own row",
                )
            )
        if m["idsPerExample"] != d["idsPerExample"]:
            found.append(
                _line(
                    f"{mk}.idsPerExample",
                    m["idsPerExample"],
                    f"{dk}.idsPerExample ({d['idsPerExample']}), the ids of each example",
                )
            )
        return found
    key = "features" if model.name == "linear" else "inputs"
    width, source = (
        (d["features"], f"{dk}.features")
        if dataset.name == "synthetic"
        else (DIGITS_WIDTH, "8x8 images")
    )
    if m[key] is not None and m[key] != width:
        found.append(
            _line(f"{mk}.{key}", m[key], f"{width}, the width of x in {dataset.name} ({source})")
        )
    if model.name == "mlp" and dataset.name == "synthetic":
        found.append(
            _line(
                f"{path}.dataset.name",
                dataset.name,
                "a dataset of class labels for model mlp (digits, idx or your files): "
                "synthetic's y is a real number",
            )
        )
    if model.name == "mlp" and dataset.name == "digits" and m["classes"] < DIGITS_CLASSES:
        found.append(
            _line(
                f"{mk}.classes",
                m["classes"],
                f"at least {DIGITS_CLASSES}: digits' labels are 0..{DIGITS_CLASSES - 1}",
            )
        )
    return found


def _line(path: str, value: object, expected: str) -> str:
    return str(_fail(path, value, expected))


class Replicas(NamedTuple):
    """How many workers and ps a job has, and the fields that say so (what errors name): a
    manifest's replicaSpecs, or a task's TF_CONFIG."""

    workers: int
    ps: int
    workers_field: str = "spec.replicaSpecs.worker.replicas"
    ps_field: str = "spec.replicaSpecs.ps.replicas"


def replica_problems(
    training: TrainingConfig, replicas: Replicas, *, path: str, refused_dataset: bool = False
) -> list[str]:
    """What a job with these tasks would crash or hang on with `training`: no ps to keep the
    parameters (every task fails), a sync step that waits for more workers than there are (a
    deadlock), a built-in dataset with fewer training examples than workers. The operator
    checks a manifest with it (`problems`), a task its TF_CONFIG at start (`roles`)."""
    found = []
    if replicas.ps < 1:
        found.append(
            _line(
                replicas.ps_field,
                replicas.ps,
                "an integer >= 1 while there are workers: the workers keep their parameters "
                "on the ps tasks",
            )
        )
    aggregate = training.replicasToAggregate
    if training.mode == "sync" and aggregate is not None and aggregate > replicas.workers:
        found.append(
            _line(
                f"{path}.replicasToAggregate",
                aggregate,
                f"at most the number of workers ({replicas.workers}, {replicas.workers_field}): "
                "a sync step waits for that many workers' gradients",
            )
        )
    dataset = training.dataset
    if not refused_dataset and dataset.module is None and dataset.name in ("synthetic", "sparse"):
        examples = catalog.check_dataset(dataset.name, dataset.kwargs)["examples"]
        if examples < replicas.workers:
            found.append(
                _line(
                    f"{path}.dataset.kwargs.examples",
                    examples,
                    f"at least the number of workers ({replicas.workers}, "
                    f"{replicas.workers_field}): each worker trains on its own share",
                )
            )
    return found


def _check(
    raw: object, path: str, tasks: Replicas | None = None
) -> tuple[TrainingConfig, list[str]]:
    """The configuration with defaults applied, and every independent problem found (the
    configuration means nothing unless there are none); with `tasks`, the rules that
    compare it with the job's tasks too."""
    try:
        top = _Reader(raw, path, TrainingConfig)
    except TrainingConfigError as err:
        return TrainingConfig(), [str(err)]
    found = _Problems()
    default = TrainingConfig()
    # None when refused: the cross-field rules skip a section already refused.
    model = found.check(None, lambda: _model(top.get("model"), f"{path}.model"))
    dataset = found.check(
        None,
        lambda: _dataset(
            top.get("dataset"), f"{path}.dataset", default=_default_dataset(top.get("model"))
        ),
    )
    async_mode: tuple[str, int | None, int | None] = (default.mode, None, None)
    mode, replicas, staleness = found.check(async_mode, lambda: _mode(top))
    optimizer = found.check(
        default.optimizer,
        lambda: (
            OptimizerConfig.from_dict(top.get("optimizer"), where=f"{path}.optimizer")
            if "optimizer" in top.raw
            else _default_optimizer()
        ),
    )

    def integer(key: str, fallback: int, *, minimum: int) -> int:
        return found.check(
            fallback, lambda: top.integer(key, fallback, minimum=minimum) or fallback
        )

    def number(key: str, fallback: float, *, minimum: float) -> float:
        return found.check(fallback, lambda: top.number(key, fallback, minimum=minimum))

    place = found.check(
        default.placement, lambda: _placement(top.get("placement"), f"{path}.placement")
    )
    checkpoint = found.check(None, lambda: _checkpoint(top.get("checkpoint"), f"{path}.checkpoint"))
    steps = integer("steps", default.steps, minimum=1)
    batch_size = integer("batchSize", default.batchSize, minimum=1)
    seed = integer("seed", default.seed, minimum=0)
    eval_every = integer("evalEverySteps", default.evalEverySteps, minimum=1)
    log_every = number("logEverySeconds", default.logEverySeconds, minimum=0.1)
    startup_timeout = number("startupTimeoutSeconds", default.startupTimeoutSeconds, minimum=1.0)
    # None when refused: the rule that compares the two skips a value already refused.
    heartbeat = found.check(
        None, lambda: top.number("heartbeatSeconds", default.heartbeatSeconds, minimum=0.05)
    )
    worker_timeout = found.check(
        None, lambda: top.number("workerTimeoutSeconds", default.workerTimeoutSeconds, minimum=0.5)
    )
    progress_timeout = found.check(
        default.progressTimeoutSeconds,
        lambda: top.number("progressTimeoutSeconds", default.progressTimeoutSeconds, minimum=0.0),
    )
    on_divergence = found.check(
        None,
        lambda: (
            top.string("onDivergence", default.onDivergence, allowed=ON_DIVERGENCE)
            or default.onDivergence
        ),
    )
    max_rollbacks = found.check(
        default.maxRollbacks,
        lambda: top.integer("maxRollbacks", default.maxRollbacks, minimum=0) or 0,
    )
    summary_every = integer("summaryEverySteps", default.summaryEverySteps, minimum=1)
    export_path = found.check(None, lambda: top.string("exportPath", None))
    tensorboard = found.check(
        None, lambda: _tensorboard(top.get("tensorboard"), f"{path}.tensorboard")
    )
    found.check(None, top.done)
    if heartbeat is not None and worker_timeout is not None and worker_timeout <= heartbeat:
        found.add(
            _fail(
                f"{path}.workerTimeoutSeconds",
                worker_timeout,
                f"more than heartbeatSeconds ({heartbeat})",
            )
        )
    if model is not None and dataset is not None:
        found.found += _fit_problems(model, dataset, path=path)
    if on_divergence == "rollback" and checkpoint is not None and checkpoint.dir is None:
        found.add(
            _fail(
                f"{path}.onDivergence",
                on_divergence,
                f'"fail" unless {path}.checkpoint.dir is set: a rollback restores the last '
                "checkpoint",
            )
        )
    training = TrainingConfig(
        model=model or default.model,
        dataset=dataset or default.dataset,
        mode=mode,
        replicasToAggregate=replicas,
        maxStaleness=staleness,
        steps=steps,
        batchSize=batch_size,
        seed=seed,
        optimizer=optimizer,
        placement=place,
        checkpoint=checkpoint or default.checkpoint,
        evalEverySteps=eval_every,
        logEverySeconds=log_every,
        heartbeatSeconds=heartbeat or default.heartbeatSeconds,
        workerTimeoutSeconds=worker_timeout or default.workerTimeoutSeconds,
        startupTimeoutSeconds=startup_timeout,
        exportPath=export_path,
        tensorboard=tensorboard,
        progressTimeoutSeconds=progress_timeout,
        onDivergence=on_divergence or default.onDivergence,
        maxRollbacks=max_rollbacks,
        summaryEverySteps=summary_every,
    )
    if tasks is not None:
        found.found += replica_problems(training, tasks, path=path, refused_dataset=dataset is None)
    return training, found.found


def parse(raw: object, *, path: str = "training") -> TrainingConfig:
    """Validates `raw` (the parsed JSON/YAML object) and applies the defaults. Raises
    `TrainingConfigError` naming the first problem; its `problems` names them all."""
    training, found = _check(raw, path)
    if found:
        raise TrainingConfigError(found[0], problems=found)
    return training


def problems(raw: object, *, path: str = "training", replicas: Replicas | None = None) -> list[str]:
    """Every independent problem of `raw`, one line each ([] when `parse` accepts it): a
    misspelt model and a misspelt optimizer are two. A problem that follows from another (the
    kwargs of a model whose name is wrong) is not listed. With `replicas` (a manifest's
    replicaSpecs), `replica_problems` too."""
    return _check(raw, path, replicas)[1]


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
