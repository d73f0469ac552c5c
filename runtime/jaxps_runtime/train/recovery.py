"""How the chief brings the ps tier to a known state: adopt it, restore it, or initialise it.

- At start, if every ps is READY at one epoch, the chief restarted while the ps lived on: it
  adopts their state, so the global step never goes backwards (TensorFlow's chief restores
  the checkpoint instead and loses the progress since, TF#7767).
- Otherwise (first start, or a ps came back empty) every shard is rolled back to the newest
  committed checkpoint, at a new epoch, so no ps is silently reset alone (TF#2461). A shard
  file that fails its checksum is reported by name and the previous checkpoint is tried.
- With no usable checkpoint the variables are initialised from the seed, at step 0.
A checkpoint made with another placement (another number of ps, strategy, minShardBytes) is
cut for this job's (`reshard`); one made for another model or optimizer is refused
(`CheckpointError`): the chief stops with that error rather than train from something it
cannot load.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.client.psclient import PsClient, PsClientError
from jaxps_runtime.ps import shardfile
from jaxps_runtime.train import checkpoint, reshard
from jaxps_runtime.train.task import Task
from jaxps_runtime.wire.terms import Mode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ready:
    """The ps tier's state once brought up."""

    epoch: int
    step: int
    how: str  # "adopted", "restored" or "initialised"


def bring_up(
    client: PsClient,
    task: Task,
    *,
    mode: Mode,
    workers: list[str],
    adopt: bool,
    epoch_floor: int = 0,
) -> Ready:
    """Adopts (if `adopt` and every ps is READY at one epoch), restores, or initialises."""
    statuses = [client.status(ps, timeout=30) for ps in range(len(client.addresses))]
    epochs = {s.id.cluster_epoch for s in statuses}
    if (
        adopt
        and all(s.state == ps_pb2.READY for s in statuses)
        and len(epochs) == 1
        and 0 not in epochs
    ):
        client.epoch = epochs.pop()
        client.incarnations = [s.id.ps_incarnation for s in statuses]
        step = min(s.step for s in statuses)
        log.info("adopting the live ps state at step %d (epoch %d)", step, client.epoch)
        return Ready(client.epoch, step, "adopted")
    epoch = max(*epochs, epoch_floor) + 1
    client.incarnations = [0] * len(client.addresses)
    return restore_or_initialise(client, task, epoch=epoch, mode=mode, workers=workers)


def _root(task: Task) -> Path | None:
    directory = task.training.checkpoint.dir
    return Path(directory) if directory else None


def _compatible(manifest: checkpoint.Manifest, task: Task, *, root: Path | None, ps: int) -> None:
    """Raises `checkpoint.IncompatibleCheckpointError` (final: InvalidTraining) for a
    committed checkpoint this job cannot restore, naming what differs and the field."""
    try:
        if reshard.needed(manifest, task.placement):  # cut for this one, if the model's
            reshard.check(manifest, task.placement)
        optimizer = task.training.optimizer.to_json()
        if manifest.optimizer != optimizer:
            raise checkpoint.IncompatibleCheckpointError(
                f"checkpoint of step {manifest.step} was made with optimizer "
                f"{manifest.optimizer}, the job uses {optimizer}"
            )
        files = sorted(r.ps for r in manifest.shards)
        saved = int(manifest.placement.get("numPs", ps))
        if files != list(range(saved)):
            raise checkpoint.IncompatibleCheckpointError(
                f"checkpoint of step {manifest.step} has files for ps {files}, made by {saved} ps"
            )
    except checkpoint.IncompatibleCheckpointError as err:
        raise checkpoint.IncompatibleCheckpointError(
            f"training.checkpoint.dir {str(root)!r} holds a checkpoint this job cannot restore: "
            f"{err}; give the job another checkpoint.dir, or remove that one"
        ) from None


def restore_or_initialise(
    client: PsClient, task: Task, *, epoch: int, mode: Mode, workers: list[str]
) -> Ready:
    training = task.training
    root = _root(task)
    for manifest in checkpoint.committed(root) if root else []:
        _compatible(manifest, task, root=root, ps=len(client.addresses))
        files = [(r.file, r.sha256) for r in sorted(manifest.shards, key=lambda r: r.ps)]
        cursors = [dict(r.cursors) for r in sorted(manifest.shards, key=lambda r: r.ps)]
        made: Path | None = None
        if reshard.needed(manifest, task.placement):
            assert root is not None
            try:
                files, cursors, made = reshard.reshard(manifest, task, root=root)
            except (shardfile.ShardFileError, checkpoint.CheckpointError, KeyError) as err:
                log.error(
                    "cannot cut the checkpoint of step %d for %d ps: %s; trying the previous one",
                    manifest.step,
                    len(client.addresses),
                    err,
                )
                continue
            log.info(
                "cut the checkpoint of step %d (%s ps, placement %s, minShardBytes %s) for "
                "this job's placement (%d ps)",
                manifest.step,
                manifest.placement.get("numPs"),
                manifest.placement.get("strategy"),
                manifest.placement.get("minShardBytes"),
                len(client.addresses),
            )
        client.init(
            None,
            optimizer=training.optimizer,
            epoch=epoch,
            step=manifest.step,
            mode=mode,
            workers=workers,
            tables=set(task.tables),
            optimizers=task.optimizers,
            dynamic=task.dynamic,
        )
        try:
            client.restore(files, step=manifest.step, cursors=cursors)
        except PsClientError as err:
            if err.code != grpc.StatusCode.DATA_LOSS:
                raise
            log.error(
                "cannot restore the checkpoint of step %d: %s; trying the previous one",
                manifest.step,
                err.details,
            )
            epoch += 1  # a new epoch per attempt: nothing of this one can land on the next
            continue
        finally:
            if made is not None:  # the ps hold it now; a later rollback cuts it again
                shutil.rmtree(made, ignore_errors=True)
        log.info(
            "restored every ps from the checkpoint of step %d (epoch %d)", manifest.step, epoch
        )
        return Ready(epoch, manifest.step, "restored")
    if root is not None:
        log.info("no usable checkpoint in %s: initialising from seed %d", root, training.seed)
    params = task.initial_params()
    client.init(
        params,
        optimizer=training.optimizer,
        epoch=epoch,
        mode=mode,
        workers=workers,
        tables=set(task.tables),
        optimizers=task.optimizers,
        dynamic=task.dynamic,
    )
    log.info(
        "initialised %d variables (%.1f MB) from seed %d on %d ps at epoch %d",
        len(params),
        sum(v.nbytes for v in params.values()) / 1e6,
        training.seed,
        len(client.addresses),
        epoch,
    )
    return Ready(epoch, 0, "initialised")
