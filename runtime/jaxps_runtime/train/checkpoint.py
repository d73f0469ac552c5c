"""Checkpoints, as the chief commits and finds them.

A checkpoint of step S is `<dir>/step-<S>/ps-<i>.npz` (one file per ps, written by that ps,
see `shardfile`) plus `<dir>/manifest-<S>.json`, written by the chief only after every ps
acknowledged its file. The manifest holds the step, epoch, placement map, optimizer, mode,
data cursors and each file's SHA-256; it is written atomically (temporary file, fsync, rename),
so it exists whole or not at all. A checkpoint is committed exactly when its manifest exists:
a crash at any moment leaves the previous committed checkpoint, never a broken one.

Assumes a filesystem every ps and the chief share (a PVC or a local directory), as
TensorFlow's Saver does. Not thread-safe: the chief commits one checkpoint at a time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jaxps_runtime.client import psclient
from jaxps_runtime.config import training as config
from jaxps_runtime.train import outcome

log = logging.getLogger(__name__)
MANIFEST = re.compile(r"^manifest-(\d{9})\.json$")


class CheckpointError(Exception):
    """A checkpoint cannot be used; the message says which and why."""


class IncompatibleCheckpointError(CheckpointError, outcome.JobFailure):
    """A committed checkpoint of another model, placement, optimizer or ps count: every
    replacement chief would meet it again, so the job fails at once (InvalidTraining) rather
    than retrying to its backoff limit."""

    exit_code = config.EXIT_INVALID_TRAINING
    reason = config.FINAL_EXITS[config.EXIT_INVALID_TRAINING]


@dataclass(frozen=True)
class ShardRecord:
    ps: int
    file: str
    sha256: str
    bytes: int
    cursors: dict[str, int] = field(default_factory=dict)  # this ps's data positions


@dataclass(frozen=True)
class Manifest:
    step: int
    epoch: int
    placement: dict[str, Any]
    optimizer: str
    mode: str
    cursors: dict[str, int]
    shards: list[ShardRecord]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Manifest:
        return cls(
            step=int(raw["step"]),
            epoch=int(raw["epoch"]),
            placement=dict(raw["placement"]),
            optimizer=str(raw["optimizer"]),
            mode=str(raw["mode"]),
            cursors={k: int(v) for k, v in raw["cursors"].items()},
            shards=[
                ShardRecord(
                    ps=int(s["ps"]),
                    file=str(s["file"]),
                    sha256=str(s["sha256"]),
                    bytes=int(s["bytes"]),
                    cursors={k: int(v) for k, v in s.get("cursors", {}).items()},
                )
                for s in raw["shards"]
            ],
        )


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def manifest_path(root: Path, step: int) -> Path:
    return root / f"manifest-{step:09d}.json"


def commit(root: Path, manifest: Manifest) -> Path:
    """Writes the manifest atomically: from this moment the checkpoint exists."""
    path = manifest_path(root, manifest.step)
    partial = path.with_name(path.name + ".tmp")
    with partial.open("w") as out:
        json.dump(asdict(manifest), out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    partial.replace(path)
    directory = os.open(root, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


def committed(root: Path) -> list[Manifest]:
    """Committed checkpoints, newest first; unreadable manifests are skipped with a warning."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if not MANIFEST.match(entry.name):
            continue
        try:
            found.append(Manifest.from_dict(json.loads(entry.read_text())))
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring unreadable manifest %s: %s", entry, err)
    return sorted(found, key=lambda m: m.step, reverse=True)


def prune(root: Path, *, keep: int, protect: Sequence[int] = ()) -> None:
    """Deletes all but the newest `keep` committed checkpoints, manifest first."""
    for manifest in committed(root)[keep:]:
        if manifest.step in protect:
            continue
        manifest_path(root, manifest.step).unlink(missing_ok=True)
        shutil.rmtree(step_dir(root, manifest.step), ignore_errors=True)
    # Shard directories without a manifest are checkpoints that never committed.
    steps = {m.step for m in committed(root)}
    for entry in root.glob("step-*"):
        number = entry.name.removeprefix("step-")
        if (
            number.isascii()
            and number.isdigit()
            and int(number) not in steps
            and int(number) not in protect
        ):
            shutil.rmtree(entry, ignore_errors=True)


def save(
    client: Any,
    *,
    root: Path,
    step: int,
    epoch: int,
    placement: dict[str, Any],
    optimizer: str,
    mode: str,
    keep: int,
    timeout: float,
) -> Manifest:
    """Every ps saves its part at `step`; then the manifest commits the checkpoint, with the
    data positions each part was taken with (each ps restores its own: a batch is in one ps's
    part and not yet in another's when a push was in flight) and the lowest over the ps (the
    shard queue's view: the batches every part holds)."""
    replies = client.save(step=step, directory=str(step_dir(root, step)), timeout=timeout)
    epochs = {r.id.cluster_epoch for r in replies}
    if epochs != {epoch}:
        raise CheckpointError(
            f"checkpoint of step {step}: the ps answered at epochs "
            f"{sorted(epochs)}, not {epoch} (a rollback happened meanwhile)"
        )
    manifest = Manifest(
        step=step,
        epoch=epoch,
        placement=placement,
        optimizer=optimizer,
        mode=mode,
        cursors=psclient.merged_cursors(replies, how=min),
        shards=[
            ShardRecord(ps=i, file=r.file, sha256=r.sha256, bytes=r.bytes, cursors=dict(r.cursors))
            for i, r in enumerate(replies)
        ],
    )
    commit(root, manifest)
    prune(root, keep=keep, protect=(step,))
    return manifest
