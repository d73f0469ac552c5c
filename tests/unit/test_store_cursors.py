"""The ps store records each data shard's position with the update its push makes: positions
move with the step (so a snapshot holds the positions its values match), a restore brings back
that ps's positions, and a push that does not count frees the batch it claimed. The store is
driven directly, without gRPC: a claim (`store.claim`), then the mode's policy counts the push
as the servicer does."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.client.psclient import merged_cursors
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.ps.modes.policy import Push
from jaxps_runtime.ps.positions import Claim
from jaxps_runtime.ps.store import ParameterStore
from jaxps_runtime.wire import terms
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


def _claim(store: ParameterStore, shard: str, cursor: int, lease: int = 5) -> Claim:
    claim = store.claim(shard=shard, cursor=cursor, lease=lease)
    assert isinstance(claim, Claim), claim
    return claim


def _refusal_word(store: ParameterStore, shard: str, cursor: int, lease: int = 5) -> str:
    refused = store.claim(shard=shard, cursor=cursor, lease=lease)
    assert isinstance(refused, str), refused
    return terms.refusal_word(refused)


def _async_push(store: ParameterStore, push_id: str, claim: Claim | None) -> bool:
    """An async push as the servicer makes it: admit, apply on arrival, count."""
    assert store.policy.admit(0) is None
    store.apply_dense(store.shards.held("w", where="t"), _grad(store), push_id=push_id).result()
    return store.policy.count(Push(push_id, 0, "worker-1", claim, {})).accepted


def test_async_pushes_move_a_shards_position_into_status_and_snapshots(
    stores: list[ParameterStore],
) -> None:
    store = _store(Mode(kind=ps_pb2.ASYNC))
    stores.append(store)
    for cursor in (1, 2, 3):
        claim = _claim(store, "0:2", cursor)
        assert store.cursors() == ({"0:2": cursor - 1} if cursor > 1 else {})  # not yet
        assert _async_push(store, f"p{cursor}", claim)
    assert _async_push(store, "no-data", None)  # a push with no batch moves no position
    assert store.step == 4
    assert store.cursors() == {"0:2": 3}  # what Status reports
    snapshot = store.snapshot_at(4, is_active=lambda: True)
    assert snapshot.step == 4
    assert snapshot.cursors == {"0:2": 3}
    assert _refusal_word(store, "0:2", 3) == terms.APPLIED  # pushed again: not applied again


def test_a_duplicate_push_counts_nothing_and_frees_its_claim(
    stores: list[ParameterStore],
) -> None:
    store = _store(Mode(kind=ps_pb2.ASYNC))
    stores.append(store)
    assert _async_push(store, "p1", _claim(store, "0:0", 1))
    claim = _claim(store, "0:0", 2)
    assert _refusal_word(store, "0:0", 2) == terms.BUSY  # while it is in flight
    duplicate = store.policy.count(Push("p1", 0, "worker-1", claim, {}))  # a retried id
    assert "duplicate" in duplicate.reason
    assert store.step == 1
    assert store.cursors() == {"0:0": 1}  # its batch did not move the shard on
    _claim(store, "0:0", 2)  # and is free to be pushed again


def test_sync_positions_land_with_the_step_their_gradients_make(
    stores: list[ParameterStore],
) -> None:
    store = _store(Mode(kind=ps_pb2.SYNC))
    stores.append(store)
    held = store.shards.held("w", where="t")
    store.policy.count(
        Push("a", 0, "worker-0", _claim(store, "0:0", 1), {"w": (held, _grad(store))})
    )
    # One of two gradients in: the step is not applied, so neither is the position; the batch
    # is claimed meanwhile (a second push of it waits)
    assert store.cursors() == {}
    assert _refusal_word(store, "0:0", 1) == terms.BUSY
    store.policy.count(
        Push("b", 0, "worker-1", _claim(store, "0:1", 1, lease=6), {"w": (held, _grad(store))})
    )
    assert store.step == 1
    assert store.cursors() == {"0:0": 1, "0:1": 1}
    assert store.snapshot_at(1, is_active=lambda: True).cursors == {"0:0": 1, "0:1": 1}


def test_a_stale_sync_push_frees_its_claim_and_moves_nothing(
    stores: list[ParameterStore],
) -> None:
    store = _store(Mode(kind=ps_pb2.SYNC))
    stores.append(store)
    held = store.shards.held("w", where="t")
    store.policy.count(Push("a", 0, "worker-0", None, {"w": (held, _grad(store))}))
    store.policy.count(Push("b", 0, "worker-1", None, {"w": (held, _grad(store))}))
    assert store.step == 1
    # worker-0's next batch, computed at step 0: the step moved on
    refused = store.policy.count(
        Push("c", 0, "worker-0", _claim(store, "0:0", 1), {"w": (held, _grad(store))})
    )
    assert not refused.accepted
    assert "stale" in refused.reason
    assert store.cursors() == {}
    _claim(store, "0:0", 1)  # computed again at step 1, it is pushed again


def test_a_second_sync_push_of_a_worker_in_a_step_frees_its_claim(
    stores: list[ParameterStore],
) -> None:
    store = _store(Mode(kind=ps_pb2.SYNC))
    stores.append(store)
    held = store.shards.held("w", where="t")
    store.policy.count(
        Push("a", 0, "worker-0", _claim(store, "0:0", 1), {"w": (held, _grad(store))})
    )
    second = store.policy.count(
        Push("a2", 0, "worker-0", _claim(store, "0:5", 1), {"w": (held, _grad(store))})
    )
    assert "duplicate" in second.reason  # one gradient a worker a step
    store.policy.count(Push("b", 0, "worker-1", None, {"w": (held, _grad(store))}))
    assert store.cursors() == {"0:0": 1}  # the first batch only
    _claim(store, "0:5", 1)


def test_a_restore_brings_back_that_ps_positions_of_the_checkpoint(
    stores: list[ParameterStore],
) -> None:
    store = _store(Mode(kind=ps_pb2.ASYNC))
    stores.append(store)
    for cursor in (1, 2):
        assert _async_push(store, f"p{cursor}", _claim(store, "1:1", cursor, lease=40))
    snapshot = store.snapshot_at(2, is_active=lambda: True)
    assert snapshot.cursors == {"1:1": 2}
    store.init(epoch=2, specs=[SPEC], optimizer=SGD, step=0, mode=Mode(kind=ps_pb2.ASYNC))
    assert store.cursors() == {}  # a new cluster epoch starts from what it is given
    store.restore(
        step=1,
        values={"w": np.asarray(snapshot.values["w"])},
        states={"w": [np.asarray(x) for x in jax.tree_util.tree_leaves(snapshot.states["w"])]},
        where="test",
        cursors={"3:1": 1, "3:4": 2, "worker-0": 25},  # an older checkpoint's, and junk
    )
    assert store.step == 1
    assert store.cursors() == {"3:1": 1, "3:4": 2}  # the checkpoint's, even if lower
    assert _refusal_word(store, "3:1", 1, lease=41) == terms.APPLIED
    _claim(store, "3:1", 2, lease=41)  # the batch after the checkpoint is pushed again


class _Reply:
    def __init__(self, cursors: dict[str, int]) -> None:
        self.cursors = cursors


def test_merged_positions_over_the_ps() -> None:
    replies = [_Reply({"0:0": 4, "0:1": 9}), _Reply({"0:0": 5})]
    assert merged_cursors(replies, how=max) == {"0:0": 5, "0:1": 9}
    # min: a shard one ps has not heard of is at 0 there (that ps applied none of its batches)
    assert merged_cursors(replies, how=min) == {"0:0": 4, "0:1": 0}
    assert merged_cursors([], how=max) == {}
