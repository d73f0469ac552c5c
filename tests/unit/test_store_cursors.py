"""The ps store records each worker's data cursor with the update its push makes: snapshots
hold the cursors that match their values, a restore brings them back, and refused pushes still
move a worker on. The store is driven directly, without gRPC."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.client.psclient import merged_cursors
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.ps.modes.policy import Push
from jaxps_runtime.ps.store import ParameterStore
from jaxps_runtime.wire.streams import Spec
from jaxps_runtime.wire.terms import Mode

SPEC = Spec("w", (4,), np.dtype(np.float32))
SGD = OptimizerConfig("sgd", {"learning_rate": 1.0})


def _store(mode: Mode, workers: tuple[str, ...] = ("worker-0", "worker-1")) -> ParameterStore:
    store = ParameterStore(job_id="j", task="ps-0")
    store.init(epoch=1, specs=[SPEC], optimizer=SGD, step=0, mode=mode, workers=workers)
    store.assign("w", np.zeros(4, np.float32)).result()
    return store


@pytest.fixture
def stores() -> Iterator[list[ParameterStore]]:
    made: list[ParameterStore] = []
    yield made
    for store in made:
        store.close()


def _grad(store: ParameterStore) -> np.ndarray:
    buffer = store.shards.held("w", where="test").staging()
    buffer[:] = 1.0
    return buffer


def test_async_pushes_carry_the_cursor_into_status_and_snapshots(
    stores: list[ParameterStore],
) -> None:
    store = _store(Mode(kind=ps_pb2.ASYNC))
    stores.append(store)
    for cursor in (1, 2, 3):
        assert store.policy.admit(0) is None
        store.apply_dense(
            store.shards.held("w", where="t"), _grad(store), push_id=f"p{cursor}"
        ).result()
        store.policy.count(Push(f"p{cursor}", 0, "worker-1", cursor, {}))
    assert store.cursors() == {"worker-1": 3}
    # A retried push (same push_id) counts nothing and moves no cursor back.
    store.policy.count(Push("p2", 0, "worker-1", 2, {}))
    assert store.cursors() == {"worker-1": 3}
    snapshot = store.snapshot_at(3, is_active=lambda: True)
    assert snapshot.step == 3
    assert snapshot.cursors == {"worker-1": 3}


def test_sync_cursors_land_with_the_step_their_gradients_make(
    stores: list[ParameterStore],
) -> None:
    store = _store(Mode(kind=ps_pb2.SYNC))
    stores.append(store)
    held = store.shards.held("w", where="t")
    store.policy.count(Push("a", 0, "worker-0", 5, {"w": (held, _grad(store))}))
    # One of two gradients in: the step is not applied, so neither is the cursor.
    assert store.cursors() == {}
    store.policy.count(Push("b", 0, "worker-1", 7, {"w": (held, _grad(store))}))
    assert store.step == 1
    assert store.cursors() == {"worker-0": 5, "worker-1": 7}
    # A stale push used its batch all the same: the worker (and a restart of it) goes on.
    refused = store.policy.count(Push("c", 0, "worker-0", 6, {"w": (held, _grad(store))}))
    assert not refused.accepted
    assert "stale" in refused.reason
    assert store.cursors() == {"worker-0": 6, "worker-1": 7}


def test_a_restore_brings_back_the_checkpoints_cursors(stores: list[ParameterStore]) -> None:
    store = _store(Mode(kind=ps_pb2.ASYNC))
    stores.append(store)
    store.note_cursor("worker-0", 40)
    snapshot = store.snapshot_at(0, is_active=lambda: True)
    store.init(epoch=2, specs=[SPEC], optimizer=SGD, step=0, mode=Mode(kind=ps_pb2.ASYNC))
    assert store.cursors() == {}  # a new epoch starts from what it is given
    store.restore(
        step=0,
        values={"w": np.asarray(snapshot.values["w"])},
        states={"w": [np.asarray(x) for x in jax.tree_util.tree_leaves(snapshot.states["w"])]},
        where="test",
        cursors={"worker-0": 25},
    )
    assert store.cursors() == {"worker-0": 25}  # the checkpoint's, even if lower


class _Reply:
    def __init__(self, **cursors: int) -> None:
        self.cursors = {k.replace("_", "-"): v for k, v in cursors.items()}


def test_merged_cursors_over_the_ps() -> None:
    replies = [_Reply(worker_0=4, worker_1=9), _Reply(worker_0=5)]
    assert merged_cursors(replies, how=max) == {"worker-0": 5, "worker-1": 9}
    # min: a worker one ps has not heard of is at 0 there (that ps's part lacks its pushes)
    assert merged_cursors(replies, how=min) == {"worker-0": 4, "worker-1": 0}
    assert merged_cursors([], how=max) == {}
