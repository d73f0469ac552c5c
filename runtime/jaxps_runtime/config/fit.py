"""The rules between fields of `spec.training`, and between it and the job's tasks: what a
job would crash or hang on although each field is valid alone. Each rule is skipped when a
field it compares was refused (the caller passes None for it).

Standard library only; pure and thread-safe.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxps_runtime.config import catalog
from jaxps_runtime.config.mode import ModeKind, TrainingMode
from jaxps_runtime.config.reader import line
from jaxps_runtime.config.sections import DatasetConfig, ModelConfig

DIGITS_WIDTH, DIGITS_CLASSES = 64, 10  # scikit-learn's 8x8 digits, labels 0..9
_READS = {"linear": "x", "mlp": "x", "embedding": "ids"}  # the batch key a built-in model reads


def fit_problems(model: ModelConfig, dataset: DatasetConfig, *, path: str) -> list[str]:
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
            line(
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
                line(
                    f"{mk}.rows",
                    m["rows"],
                    f"at least {dk}.idRange ({d['idRange']}): the dataset's ids run up to "
                    f"{d['idRange'] - 1} and each reads its own row",
                )
            )
        if m["idsPerExample"] != d["idsPerExample"]:
            found.append(
                line(
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
            line(f"{mk}.{key}", m[key], f"{width}, the width of x in {dataset.name} ({source})")
        )
    if model.name == "mlp" and dataset.name == "synthetic":
        found.append(
            line(
                f"{path}.dataset.name",
                dataset.name,
                "a dataset of class labels for model mlp (digits, idx or your files): "
                "synthetic's y is a real number",
            )
        )
    if model.name == "mlp" and dataset.name == "digits" and m["classes"] < DIGITS_CLASSES:
        found.append(
            line(
                f"{mk}.classes",
                m["classes"],
                f"at least {DIGITS_CLASSES}: digits' labels are 0..{DIGITS_CLASSES - 1}",
            )
        )
    return found


class Replicas(NamedTuple):
    """How many workers and ps a job has, and the fields that say so (what errors name): a
    manifest's replicaSpecs, or a task's TF_CONFIG."""

    workers: int
    ps: int
    workers_field: str = "spec.replicaSpecs.worker.replicas"
    ps_field: str = "spec.replicaSpecs.ps.replicas"


def replica_problems(
    mode: TrainingMode,
    dataset: DatasetConfig | None,
    replicas: Replicas,
    *,
    path: str,
) -> list[str]:
    """What a job with these tasks would crash or hang on in this mode: no ps to keep the
    parameters (every task fails), a sync step that waits for more workers than there are (a
    deadlock), a built-in dataset (None: refused, not compared) with fewer training examples
    than workers. The operator checks a manifest with it (`problems`), a task its TF_CONFIG at
    start (`roles`), through `training.replica_problems`."""
    found = []
    if replicas.ps < 1:
        found.append(
            line(
                replicas.ps_field,
                replicas.ps,
                "an integer >= 1 while there are workers: the workers keep their parameters "
                "on the ps tasks",
            )
        )
    aggregate = mode.replicas_to_aggregate
    if mode.kind is ModeKind.SYNC and aggregate is not None and aggregate > replicas.workers:
        found.append(
            line(
                f"{path}.replicasToAggregate",
                aggregate,
                f"at most the number of workers ({replicas.workers}, {replicas.workers_field}): "
                "a sync step waits for that many workers' gradients",
            )
        )
    if dataset is not None and dataset.module is None and dataset.name in ("synthetic", "sparse"):
        examples = catalog.check_dataset(dataset.name, dataset.kwargs)["examples"]
        if examples < replicas.workers:
            found.append(
                line(
                    f"{path}.dataset.kwargs.examples",
                    examples,
                    f"at least the number of workers ({replicas.workers}, "
                    f"{replicas.workers_field}): each worker trains on its own share",
                )
            )
    return found
