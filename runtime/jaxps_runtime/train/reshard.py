"""A checkpoint taken with another placement, cut again for this job's.

`spec.replicaSpecs.ps.replicas` and `placement` are fixed while a job exists, but a new job may
resume from an earlier job's `checkpoint.dir` with more or fewer ps, another strategy or
`minShardBytes`, or a dynamic table of another `maxRows`. As long as the model's variables are
the same (names, dtypes, shapes; a dynamic table's dim), the chief reads every part of the
checkpoint and writes one part per ps of its own placement, which the ps restore as they would
their own (`recovery`):

- a dense variable is put back together from its old shards (rows along axis 0) and cut as
  the new placement cuts it; each optimizer leaf shaped like its shard goes with the rows, a
  leaf that is not (adam's step count) is the same on every shard and is kept;
- a dynamic embedding table's rows (`ps.dynamic`) go to the ps that owns their id under the
  new ps count (`dynamic.Table.restore`): keys, values, optimizer state, counts and probation
  (past a smaller `maxRows`, the rows updated longest ago are left out, as eviction would);
- the data positions: every part must hold the same ones (a part taken while a push was in
  flight holds a batch another part does not: cut into other parts, it would be applied
  twice or lost), else the checkpoint is refused, naming the parts.

The new parts are written under `<dir>/reshard-<step>-<ps>/` (not a checkpoint of their own: the
next checkpoint is cut by the new placement anyway) and removed once restored.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxps_runtime.client.placement import Placement, Shard
from jaxps_runtime.ps import dynamic, optim, shardfile
from jaxps_runtime.train import checkpoint
from jaxps_runtime.train.task import Task

Incompatible = checkpoint.IncompatibleCheckpointError


def needed(manifest: checkpoint.Manifest, placement: Placement) -> bool:
    """Whether the checkpoint was taken with another placement than `placement`."""
    return dict(manifest.placement) != placement.to_dict()


def check(manifest: checkpoint.Manifest, placement: Placement) -> None:
    """Refuses a checkpoint whose variables are not this job's (other names, dtypes or shapes;
    a dynamic table's rows aside, which are a multiple of the ps count)."""
    old = Placement.from_dict(manifest.placement)
    if set(old.dynamic) != set(placement.dynamic):
        raise Incompatible(
            f"checkpoint of step {manifest.step}: dynamic tables {sorted(old.dynamic)}, the "
            f"job has {sorted(placement.dynamic)}"
        )
    theirs = {v.name: v for v in old.variables}
    for var in placement.variables:
        saved = theirs.pop(var.name, None)
        same = saved is not None and saved.dtype == var.dtype
        if same and saved is not None and var.name in placement.dynamic:
            same = saved.shape[1:] == var.shape[1:]
        elif same and saved is not None:
            same = saved.shape == var.shape
        if not same:
            raise Incompatible(
                f"checkpoint of step {manifest.step}: variable {var.name!r} is "
                f"{_shown(saved)}, the job's model has {var.dtype}{list(var.shape)}"
            )
    if theirs:
        raise Incompatible(
            f"checkpoint of step {manifest.step}: variable {sorted(theirs)[0]!r} is not the "
            "job's model's"
        )


def _shown(variable: Any) -> str:
    return "absent" if variable is None else f"{variable.dtype}{list(variable.shape)}"


def reshard(
    manifest: checkpoint.Manifest, task: Task, *, root: Path
) -> tuple[list[tuple[str, str]], list[dict[str, int]], Path]:
    """This job's parts of the checkpoint (file, sha256 per ps), each ps's data positions, and
    the directory they were written in (to remove once restored)."""
    old = Placement.from_dict(manifest.placement)
    new = task.placement
    step_dir = checkpoint.step_dir(root, manifest.step)
    parts = {
        record.ps: shardfile.read(step_dir / Path(record.file).name, expected_sha256=record.sha256)
        for record in manifest.shards
    }
    positions = [dict(record.cursors) for record in manifest.shards]
    if any(p != positions[0] for p in positions):
        raise checkpoint.CheckpointError(
            f"checkpoint of step {manifest.step} cannot be cut for {new.num_ps} ps: its parts "
            "hold different data positions (taken while a push was in flight)"
        )
    values: list[dict[str, np.ndarray]] = [{} for _ in range(new.num_ps)]
    states: list[dict[str, list[np.ndarray]]] = [{} for _ in range(new.num_ps)]
    tables: list[dict[str, dict[str, np.ndarray]]] = [{} for _ in range(new.num_ps)]
    for var in new.variables:
        if var.name in new.dynamic:
            _tables(var.name, old, new, parts, task, into=tables)
        else:
            _dense(var.name, old, new, parts, values=values, states=states)
    out = root / f"reshard-{manifest.step:09d}-{new.num_ps}"
    shutil.rmtree(out, ignore_errors=True)
    files = []
    for ps in range(new.num_ps):
        meta = {**parts[0].meta, "task": f"ps-{ps}", "resharded_from": old.num_ps}
        meta.pop("tables", None)
        path = out / f"ps-{ps}.npz"
        digest, _ = shardfile.write(
            path, meta=meta, values=values[ps], states=states[ps], tables=tables[ps]
        )
        files.append((str(path), digest))
    return files, [dict(positions[0]) for _ in range(new.num_ps)], out


def _dense(
    name: str,
    old: Placement,
    new: Placement,
    parts: dict[int, shardfile.Contents],
    *,
    values: list[dict[str, np.ndarray]],
    states: list[dict[str, list[np.ndarray]]],
) -> None:
    """One dense variable's value and optimizer leaves, whole again, cut by `new`."""
    saved = sorted(old.shards_of(name), key=lambda s: s.start)
    pieces = [parts[s.ps].values[s.name] for s in saved]
    leaves = [parts[s.ps].states.get(s.name, []) for s in saved]
    whole = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    joined = []
    for i, first in enumerate(leaves[0]):
        rowed = np.shape(first) == np.shape(pieces[0]) and np.ndim(first) > 0
        column = [np.asarray(leaf[i]) for leaf in leaves]
        if len(column) == 1:
            joined.append((column[0], rowed))
        elif rowed:
            joined.append((np.concatenate(column), True))
        else:  # a count every shard keeps alike: the furthest any went
            joined.append((np.max(np.stack(column), axis=0).astype(column[0].dtype), False))
    for shard in new.shards_of(name):
        values[shard.ps][shard.name] = _cut(whole, shard)
        states[shard.ps][shard.name] = [
            _cut(leaf, shard) if rowed else leaf for leaf, rowed in joined
        ]


def _cut(array: np.ndarray, shard: Shard) -> np.ndarray:
    return (
        array if not shard.variable.shape else np.ascontiguousarray(array[shard.start : shard.stop])
    )


def _tables(
    name: str,
    old: Placement,
    new: Placement,
    parts: dict[int, shardfile.Contents],
    task: Task,
    *,
    into: list[dict[str, dict[str, np.ndarray]]],
) -> None:
    """One dynamic table's rows, each to the ps its id's hash names under the new count."""
    snapshots = [parts[s.ps].tables[s.name] for s in old.shards_of(name)]
    spec = task.dynamic[name]
    optimizer = task.optimizers.get(name, task.training.optimizer)
    for shard in new.shards_of(name):
        table = dynamic.Table(spec, optim.build(optimizer), ps=shard.ps, num_ps=new.num_ps)
        table.restore(snapshots)
        into[shard.ps][shard.name] = table.snapshot()
