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

The fields and their rules live on the dataclasses (`reader.setting`), the sections in
`sections`, the mode in `mode` (one `TrainingMode`), the cross-field rules in `fit`; `openapi`
checks the CRD's `spec.training` against them (`make verify`). This module puts them together
and keeps the names callers import (`OptimizerConfig`, `Replicas`, the exit codes, ...).

`tensorboard: {dir, flushSeconds}` (optional; no field, no event files): the chief writes its
training scalars under `dir/train` and the evaluator its metrics under `dir/eval`
(`summaries`); `dir` is required, a non-empty string; `flushSeconds`, an integer >= 1 (default
5), bounds how long an event waits in memory. `null` is the same as no field.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jaxps_runtime.config import catalog, fit
from jaxps_runtime.config.exits import (
    EXIT_DIVERGED,
    EXIT_INVALID_TRAINING,
    EXIT_STALLED,
    EXIT_USER_CODE,
    FINAL_EXITS,
)
from jaxps_runtime.config.fit import Replicas
from jaxps_runtime.config.mode import ModeFields, ModeKind, TrainingMode
from jaxps_runtime.config.mode import read as read_mode
from jaxps_runtime.config.reader import (
    Problems,
    Reader,
    Spec,
    TrainingConfigError,
    fail,
    setting,
    specs,
)
from jaxps_runtime.config.sections import (
    DEFAULT_FLUSH_SECONDS,
    CheckpointConfig,
    DatasetConfig,
    EmbeddingConfig,
    ModelConfig,
    OptimizerConfig,
    PlacementConfig,
    TensorBoardConfig,
    default_dataset,
    default_optimizer,
    read_dataset,
    read_embeddings,
    read_model,
    read_optimizer,
    read_plain,
    read_tensorboard,
)

__all__ = [
    "DEFAULT_FLUSH_SECONDS",
    "EXIT_DIVERGED",
    "EXIT_INVALID_TRAINING",
    "EXIT_STALLED",
    "EXIT_USER_CODE",
    "FINAL_EXITS",
    "MODES",
    "ON_DIVERGENCE",
    "CheckpointConfig",
    "DatasetConfig",
    "EmbeddingConfig",
    "ModeKind",
    "ModelConfig",
    "OptimizerConfig",
    "PlacementConfig",
    "Replicas",
    "TensorBoardConfig",
    "TrainingConfig",
    "TrainingConfigError",
    "TrainingMode",
    "load",
    "loads",
    "manifest_specs",
    "parse",
    "with_defaults",
    "problems",
    "replica_problems",
]

MODES: tuple[str, ...] = tuple(kind.value for kind in ModeKind)
ON_DIVERGENCE = ("fail", "rollback")


@dataclass(frozen=True)
class TrainingConfig:
    """`spec.training` with defaults applied. Field names are the manifest's, but for the
    mode: `training_mode` holds `mode`, `replicasToAggregate` and `maxStaleness` as one
    value, which the properties of those names show as the manifest has them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    training_mode: TrainingMode = field(default_factory=TrainingMode)
    steps: int = setting(1000, minimum=1)
    batchSize: int = setting(32, minimum=1)  # noqa: N815 - manifest spelling
    seed: int = setting(0, minimum=0)
    optimizer: OptimizerConfig = field(default_factory=default_optimizer)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evalEverySteps: int = setting(100, minimum=1)  # noqa: N815
    logEverySeconds: float = setting(5.0, minimum=0.1)  # noqa: N815
    heartbeatSeconds: float = setting(1.0, minimum=0.05)  # noqa: N815
    workerTimeoutSeconds: float = setting(30.0, minimum=0.5)  # noqa: N815
    startupTimeoutSeconds: float = setting(300.0, minimum=1.0)  # noqa: N815
    exportPath: str | None = None  # noqa: N815 - the chief writes the final parameters here
    tensorboard: TensorBoardConfig | None = None  # None: no event files
    # Stalled: the global step did not move for this long while training (0: never).
    progressTimeoutSeconds: float = setting(600.0, minimum=0.0)  # noqa: N815
    # or "rollback" to the last checkpoint
    onDivergence: str = setting("fail", allowed=ON_DIVERGENCE)  # noqa: N815
    maxRollbacks: int = setting(3, minimum=0)  # noqa: N815 - rollbacks before the job fails
    summaryEverySteps: int = setting(10, minimum=1)  # noqa: N815 - a TensorBoard point per N
    # "package.module:main": the user's own loop (`train.program`) instead of the built-in
    # one over `model`'s loss; the dataset is still the job's (its shard queue), if it reads it
    program: str | None = None
    # Dynamic embedding tables: {table: EmbeddingConfig} (`ps.dynamic`); none: every table is
    # the model's fixed [0, rows) array
    embeddings: dict[str, EmbeddingConfig] = field(default_factory=dict)

    @property
    def mode(self) -> ModeKind:
        return self.training_mode.kind

    @property
    def replicasToAggregate(self) -> int | None:  # noqa: N802 - manifest spelling
        """Sync only; None: every live worker."""
        return self.training_mode.replicas_to_aggregate

    @property
    def maxStaleness(self) -> int | None:  # noqa: N802
        """boundedStaleness only (None in the other modes)."""
        return self.training_mode.to_manifest()["maxStaleness"]  # type: ignore[return-value]

    @property
    def staleness(self) -> int:
        return self.training_mode.max_staleness

    def to_dict(self) -> dict[str, Any]:
        """The manifest's `spec.training` of this configuration, every default filled in."""
        out = asdict(self)
        del out["training_mode"]
        out.update(self.training_mode.to_manifest())
        out["optimizer"] = self.optimizer.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def manifest_specs() -> dict[str, Spec]:
    """Every field of `spec.training` as the manifest spells it, with its rules."""
    out = {key: spec for key, spec in specs(TrainingConfig).items() if key != "training_mode"}
    return {**out, **specs(ModeFields)}


def with_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` (a manifest's `spec.training`) with every default that does not depend on another
    field filled in, also inside the sections it has: what the operator hands the tasks as
    JAXPS_TRAINING and shows as the job's settings. The CRD states none of them, so that the
    apiserver stores only what the user wrote (every default it filled in was stored in every
    job and made each write of it, status included, dearer); a value of the wrong type is left
    as it is, for `problems` to name."""
    return _filled(raw, manifest_specs())


def _filled(node: Mapping[str, Any], fields: Mapping[str, Spec]) -> dict[str, Any]:
    out = dict(node)
    for key, spec in fields.items():
        if key not in out:
            if spec.default is not dataclasses.MISSING and spec.default is not None:
                default = spec.default
                out[key] = default.value if isinstance(default, enum.Enum) else default
        elif spec.section is not None and isinstance(out[key], Mapping):
            out[key] = _filled(out[key], specs(spec.section))
    return out


# Read in this order after the sections (the order of `problems`).
_SCALARS = (
    "steps",
    "batchSize",
    "seed",
    "evalEverySteps",
    "logEverySeconds",
    "startupTimeoutSeconds",
    "heartbeatSeconds",
    "workerTimeoutSeconds",
    "progressTimeoutSeconds",
    "onDivergence",
    "maxRollbacks",
    "summaryEverySteps",
    "exportPath",
    "program",
)
_REFUSED = object()


def _check(
    raw: object, path: str, tasks: Replicas | None = None
) -> tuple[TrainingConfig, list[str]]:
    """The configuration with defaults applied, and every independent problem found (the
    configuration means nothing unless there are none); with `tasks`, the rules that
    compare it with the job's tasks too."""
    try:
        top = Reader(raw, path, TrainingConfig, keys=list(manifest_specs()))
    except TrainingConfigError as err:
        return TrainingConfig(), [str(err)]
    found = Problems()
    default = TrainingConfig()
    # None when refused: the cross-field rules skip a section already refused.
    model = found.check(None, lambda: read_model(top.get("model"), f"{path}.model"))
    dataset = found.check(
        None,
        lambda: read_dataset(
            top.get("dataset"), f"{path}.dataset", default=default_dataset(top.get("model"))
        ),
    )
    training_mode = found.check(default.training_mode, lambda: read_mode(top))
    optimizer = found.check(default.optimizer, lambda: read_optimizer(top))
    place = found.check(
        default.placement,
        lambda: read_plain(top.get("placement"), f"{path}.placement", PlacementConfig),
    )
    checkpoint = found.check(
        None, lambda: read_plain(top.get("checkpoint"), f"{path}.checkpoint", CheckpointConfig)
    )
    scalars: dict[str, Any] = {
        key: found.check(_REFUSED, functools.partial(top.setting, key)) for key in _SCALARS
    }
    refused = {key for key, value in scalars.items() if value is _REFUSED}
    for key in refused:  # stands in as its default
        scalars[key] = getattr(default, key)
    tensorboard = found.check(
        None, lambda: read_tensorboard(top.get("tensorboard"), f"{path}.tensorboard")
    )
    no_tables: dict[str, EmbeddingConfig] = {}
    embeddings = found.check(
        no_tables, lambda: read_embeddings(top.get("embeddings"), f"{path}.embeddings")
    )
    found.check(None, top.done)
    batch = scalars["batchSize"]
    for table, config in embeddings.items():
        if "batchSize" not in refused and config.maxRows < batch:
            found.add(
                fail(
                    f"{path}.embeddings.{table}.maxRows",
                    config.maxRows,
                    f"at least batchSize ({batch}): the rows one batch may admit",
                )
            )
    heartbeat, worker_timeout = scalars["heartbeatSeconds"], scalars["workerTimeoutSeconds"]
    timeouts_read = not refused & {"heartbeatSeconds", "workerTimeoutSeconds"}
    if timeouts_read and worker_timeout <= heartbeat:
        found.add(
            fail(
                f"{path}.workerTimeoutSeconds",
                worker_timeout,
                f"more than heartbeatSeconds ({heartbeat})",
            )
        )
    program = scalars["program"]
    if program is not None and "program" not in refused:
        found.check(None, lambda: catalog.check_module(program, where=f"{path}.program"))
    elif model is not None and dataset is not None:  # a program's loop has no model to fit
        found.found += fit.fit_problems(model, dataset, path=path)
    on_divergence = scalars["onDivergence"]
    if on_divergence == "rollback" and checkpoint is not None and checkpoint.dir is None:
        found.add(
            fail(
                f"{path}.onDivergence",
                on_divergence,
                f'"fail" unless {path}.checkpoint.dir is set: a rollback restores the last '
                "checkpoint",
            )
        )
    training = TrainingConfig(
        model=model or default.model,
        dataset=dataset or default.dataset,
        training_mode=training_mode,
        optimizer=optimizer,
        placement=place,
        checkpoint=checkpoint or default.checkpoint,
        tensorboard=tensorboard,
        embeddings=embeddings,
        **scalars,
    )
    if tasks is not None:
        found.found += fit.replica_problems(training_mode, dataset, tasks, path=path)
    return training, found.found


def replica_problems(
    training: TrainingConfig, replicas: Replicas, *, path: str, refused_dataset: bool = False
) -> list[str]:
    """What a job with these tasks would crash or hang on with `training` (`fit.
    replica_problems`): the operator checks a manifest with it (`problems`), a task its
    TF_CONFIG at start (`roles`)."""
    dataset = None if refused_dataset else training.dataset
    return fit.replica_problems(training.training_mode, dataset, replicas, path=path)


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
    """Parses JSON (what the operator and `jaxps local` give a task) or YAML text, its
    numbers as YAML 1.2 reads them (`yamltext`: `5e-05` is a float). YAML is imported here,
    where it is read: a ps imports this module and must listen before it loads anything it
    can load later."""
    if not text.strip():
        return parse({}, path=path)
    try:
        return parse(json.loads(text), path=path)
    except json.JSONDecodeError:
        pass
    from jaxps_runtime.config import yamltext  # noqa: PLC0415

    try:
        raw = yamltext.load(text)
    except yamltext.Error as err:
        raise TrainingConfigError(f"{path}: not JSON or YAML ({err})") from err
    return parse(raw, path=path)


def load(file: Path) -> TrainingConfig:
    try:
        text = file.read_text()
    except OSError as err:
        raise TrainingConfigError(f"--training {file}: cannot read it ({err.strerror})") from err
    return loads(text, path="training")
