"""Checkpoint files and manifests: atomic, checksummed, found newest first, pruned."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optax
import pytest

from jaxps_runtime.client import placement
from jaxps_runtime.ps import shardfile
from jaxps_runtime.train import checkpoint


def _placement(num_ps: int = 2) -> dict[str, object]:
    variables = [placement.Variable("['w']", (1000, 100), "float32")]
    return placement.plan(variables, num_ps=num_ps).to_dict()


def _manifest(step: int, *, num_ps: int = 2) -> checkpoint.Manifest:
    return checkpoint.Manifest(
        step=step,
        epoch=1,
        placement=_placement(num_ps),
        optimizer="{}",
        mode="sync",
        cursors={"worker-0": step},
        shards=[checkpoint.ShardRecord(0, "f", "0" * 64, 1)],
    )


def test_a_shard_file_round_trips_values_and_optimizer_state(tmp_path: Path) -> None:
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = optax.adam(0.1).init(value)
    path = tmp_path / "step-1" / "ps-0.npz"
    digest, size = shardfile.write(path, meta={"step": 1}, values={"w": value}, states={"w": state})
    assert size == path.stat().st_size
    assert not path.with_name("ps-0.npz.tmp").exists()
    contents = shardfile.read(path, expected_sha256=digest)
    assert contents.meta == {"step": 1}
    assert np.array_equal(contents.values["w"], value)
    assert len(contents.states["w"]) == 3  # count, mu, nu


def test_a_corrupted_shard_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "ps-0.npz"
    digest, _ = shardfile.write(
        path, meta={}, values={"w": np.zeros(100, np.float32)}, states={"w": ()}
    )
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(shardfile.ShardFileError, match=f"checkpoint file {path} is corrupt"):
        shardfile.read(path, expected_sha256=digest)
    with pytest.raises(shardfile.ShardFileError, match="is missing"):
        shardfile.read(tmp_path / "nope.npz", expected_sha256=digest)


def test_committed_checkpoints_come_newest_first_and_torn_manifests_are_ignored(
    tmp_path: Path,
) -> None:
    for step in (50, 150, 100):
        checkpoint.commit(tmp_path, _manifest(step))
    (tmp_path / "manifest-000000200.json").write_text('{"step": 2')  # torn by hand
    (tmp_path / "manifest-000000250.json.tmp").write_text("{}")  # never renamed
    assert [m.step for m in checkpoint.committed(tmp_path)] == [150, 100, 50]


def test_prune_keeps_the_newest_and_removes_uncommitted_shard_directories(
    tmp_path: Path,
) -> None:
    for step in (50, 100, 150):
        checkpoint.step_dir(tmp_path, step).mkdir()
        checkpoint.commit(tmp_path, _manifest(step))
    checkpoint.step_dir(tmp_path, 200).mkdir()  # a checkpoint whose manifest never came
    (tmp_path / "step-²").mkdir()  # not ours: a digit to str.isdigit, not to int()
    checkpoint.prune(tmp_path, keep=2)
    assert [m.step for m in checkpoint.committed(tmp_path)] == [150, 100]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-000000100",
        "step-000000150",
        "step-²",
    ]
