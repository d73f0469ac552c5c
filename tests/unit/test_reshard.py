"""A checkpoint cut for another placement (`train.reshard`): every value and optimizer leaf of
the old parts lands where the new placement puts its rows; a leaf not shaped like its shard
(adam's count) is kept; different data positions on the parts, or another model, are refused.
Real shard files; the task is a stand-in with the four attributes `reshard` reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import optax
import pytest

from jaxps_runtime.client import placement
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.ps import shardfile
from jaxps_runtime.train import checkpoint, reshard

VARIABLES = [
    placement.Variable("['a']", (10, 4), "float32"),  # split over the ps
    placement.Variable("['b']", (3,), "float32"),
    placement.Variable("['c']", (), "float32"),
]


def whole(var: placement.Variable) -> np.ndarray:
    size = int(np.prod(var.shape)) if var.shape else 1
    return np.arange(size, dtype=np.float32).reshape(var.shape) + len(var.name)


def saved(tmp_path: Path, num_ps: int, **cursors: int) -> tuple[checkpoint.Manifest, Path]:
    """A checkpoint of step 7 on `num_ps` ps: adam's state of every shard, its count 7."""
    plan = placement.plan(VARIABLES, num_ps=num_ps, min_shard_bytes=16)
    root = tmp_path / "ckpt"
    records = []
    for ps in range(num_ps):
        values: dict[str, Any] = {}
        states: dict[str, Any] = {}
        for shard in plan.shards_on(ps):
            part = whole(shard.variable)
            part = part[shard.start : shard.stop] if shard.variable.shape else part
            values[shard.name] = part
            mu, nu = part * 10, part * 100
            states[shard.name] = [np.int32(7), mu, nu]
        path = checkpoint.step_dir(root, 7) / f"ps-{ps}.npz"
        digest, size = shardfile.write(
            path, meta={"step": 7, "epoch": 1, "task": f"ps-{ps}"}, values=values, states=states
        )
        records.append(checkpoint.ShardRecord(ps, str(path), digest, size, dict(cursors)))
    manifest = checkpoint.Manifest(
        step=7,
        epoch=1,
        placement=plan.to_dict(),
        optimizer="{}",
        mode="async",
        cursors=dict(cursors),
        shards=records,
    )
    return manifest, root


def task(num_ps: int, min_shard_bytes: int = 16) -> Any:
    return SimpleNamespace(
        placement=placement.plan(VARIABLES, num_ps=num_ps, min_shard_bytes=min_shard_bytes),
        dynamic={},
        optimizers={},
        training=SimpleNamespace(optimizer=OptimizerConfig("adam", {"learning_rate": 0.1})),
    )


@pytest.mark.parametrize(("old", "new", "min_bytes"), [(2, 3, 16), (3, 1, 16), (2, 2, 4096)])
def test_every_value_and_optimizer_row_lands_where_the_new_placement_puts_it(
    tmp_path: Path, old: int, new: int, min_bytes: int
) -> None:
    manifest, root = saved(tmp_path, old, **{"0:3": 2})
    job = task(new, min_bytes)
    assert reshard.needed(manifest, job.placement)
    reshard.check(manifest, job.placement)
    files, cursors, made = reshard.reshard(manifest, job, root=root)
    assert len(files) == new
    assert cursors == [{"0:3": 2}] * new
    for ps, (file, digest) in enumerate(files):
        contents = shardfile.read(Path(file), expected_sha256=digest)
        shards = job.placement.shards_on(ps)
        assert sorted(contents.values) == sorted(s.name for s in shards)
        for shard in shards:
            full = whole(shard.variable)
            want = full[shard.start : shard.stop] if shard.variable.shape else full
            np.testing.assert_array_equal(contents.values[shard.name], want)
            count, mu, nu = contents.states[shard.name]
            assert int(count) == 7
            np.testing.assert_array_equal(mu, want * 10)
            np.testing.assert_array_equal(nu, want * 100)
    assert made.parent == root


def test_the_same_placement_needs_no_cut_and_another_model_or_positions_are_refused(
    tmp_path: Path,
) -> None:
    manifest, root = saved(tmp_path, 2)
    assert not reshard.needed(manifest, task(2).placement)
    other = placement.plan([placement.Variable("['a']", (10, 5), "float32")], num_ps=2)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"variable \"\['a'\]\" is float32\[10, 4\]"
    ):
        reshard.check(manifest, other)
    uneven, root = saved(tmp_path / "uneven", 2, **{"0:3": 2})
    uneven.shards[1].cursors["0:3"] = 3  # a push in flight: in one part, not the other
    with pytest.raises(checkpoint.CheckpointError, match="different data positions"):
        reshard.reshard(uneven, task(3), root=root)


def test_adam_is_what_the_stand_in_optimizer_state_mimics() -> None:
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(optax.adam(0.1).init(np.zeros(3)))]
    assert [leaf.shape for leaf in leaves] == [(), (3,), (3,)]
