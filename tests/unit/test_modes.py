"""The training modes' policies, driven directly on a store (no gRPC): what each admits,
refuses, counts and holds back; and what a ps refuses to store."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import jax
import numpy as np
import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.ps.held import Held
from jaxps_runtime.ps.modes import bounded
from jaxps_runtime.ps.modes.policy import PsError, Push
from jaxps_runtime.ps.store import ParameterStore
from jaxps_runtime.ps.updates import finite
from jaxps_runtime.wire import streams
from jaxps_runtime.wire.streams import Spec
from jaxps_runtime.wire.terms import NONFINITE_UPDATE, Mode

SPEC = Spec("w", (4,), np.dtype(np.float32))
SGD = OptimizerConfig("sgd", {"learning_rate": 1.0})
WORKERS = ("worker-0", "worker-1")


@pytest.fixture
def store() -> Iterator[ParameterStore]:
    made = ParameterStore(job_id="j", task="ps-0")
    yield made
    made.close()


def _init(store: ParameterStore, mode: Mode, workers: tuple[str, ...] = WORKERS) -> None:
    store.init(epoch=1, specs=[SPEC], optimizer=SGD, step=0, mode=mode, workers=workers)
    store.assign("w", np.zeros(4, np.float32)).result()


def _value(store: ParameterStore) -> np.ndarray:
    return np.asarray(store.snapshot(["w"])[1][0][1])


def _dense(store: ParameterStore, value: float) -> dict[str, tuple[Held, np.ndarray]]:
    held = store.shards.held("w", where="test")
    grad = held.staging()
    grad[:] = value
    return {"w": (held, grad)}


def _async_push(store: ParameterStore, worker: str, push_id: str, step: int = 0) -> bool:
    """An async push as the servicer makes it: admit, apply on arrival, count."""
    if store.policy.admit(step) is not None:
        return False
    held = store.shards.held("w", where="test")
    store.apply_dense(held, np.ones(4, np.float32), push_id=push_id).result()
    return store.policy.count(Push(push_id, step, worker, None, {})).accepted


def test_async_applies_every_push_and_stops_at_the_last_step(store: ParameterStore) -> None:
    _init(store, Mode(kind=ps_pb2.ASYNC, last_step=3))
    assert store.policy.applies_on_arrival
    for i in range(3):
        assert _async_push(store, "worker-0", f"p{i}")
    assert store.step == 3
    refused = store.policy.admit(0)
    assert refused is not None
    assert "training is over: step 3" in refused.reason
    assert np.array_equal(_value(store), np.full(4, -3, np.float32))


def test_async_admission_reserves_the_steps_left_for_pushes_in_flight(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.ASYNC, last_step=2))
    assert store.policy.admit(0) is None
    assert store.policy.admit(0) is None
    assert store.policy.admit(0) is not None  # two in flight take the two steps left
    store.policy.release()  # one failed: its step is free again
    assert store.policy.admit(0) is None


def test_bounded_staleness_holds_a_read_back_until_the_slowest_catches_up(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.BOUNDED_STALENESS, max_staleness=1))
    for i in range(2):
        _async_push(store, "worker-0", f"fast-{i}")
    released = threading.Event()

    def read() -> None:
        store.policy.before_read("worker-0", is_active=lambda: True)
        released.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert not released.wait(0.5)  # two ahead of worker-1, one allowed
    _async_push(store, "worker-1", "slow-0")
    assert released.wait(30)
    reader.join()
    store.policy.before_read("worker-1", is_active=lambda: True)  # the slowest never waits


def test_bounded_staleness_stops_holding_back_a_worker_the_chief_dropped(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.BOUNDED_STALENESS, max_staleness=0))
    _async_push(store, "worker-0", "p0")
    store.policy.set_workers(["worker-0"])  # worker-1 died
    store.policy.before_read("worker-0", is_active=lambda: True)


def test_bounded_staleness_holds_nobody_once_the_last_step_is_reached(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.BOUNDED_STALENESS, max_staleness=0, last_step=2))
    for i in range(2):
        assert _async_push(store, "worker-0", f"p{i}")
    assert store.step == 2
    # two ahead of worker-1, but no push counts any more: held, it would wait forever
    reader = threading.Thread(
        target=store.policy.before_read,
        args=("worker-0",),
        kwargs={"is_active": lambda: True},
        daemon=True,  # held (the failure): no thread left behind
    )
    reader.start()
    reader.join(timeout=5)  # well below STALLED_SECONDS: not let through for a stall
    assert not reader.is_alive()
    assert "holds_let_through" not in store.counters.values


def test_bounded_staleness_lets_a_read_through_when_no_push_counts_for_a_while(
    store: ParameterStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker it waits for pushes nothing (held on another ps whose clocks differ, or
    hung): the hold ends rather than stalling the job."""
    monkeypatch.setattr(bounded, "STALLED_SECONDS", 0.3)
    _init(store, Mode(kind=ps_pb2.BOUNDED_STALENESS, max_staleness=0))
    assert _async_push(store, "worker-0", "p0")
    pushed = time.monotonic()
    released = threading.Event()

    def read() -> None:
        store.policy.before_read("worker-0", is_active=lambda: True)
        released.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert released.wait(30)
    assert time.monotonic() - pushed >= 0.3
    assert store.counters.values.get("holds_let_through") == 1


def test_sync_averages_one_gradient_per_worker_then_opens_the_next_step(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.SYNC))
    policy = store.policy
    assert not policy.applies_on_arrival
    assert policy.count(Push("a", 0, "worker-0", None, _dense(store, 2))).step == 0
    assert policy.awaiting() == 1
    duplicate = policy.count(Push("a2", 0, "worker-0", None, _dense(store, 100)))
    assert "duplicate" in duplicate.reason
    assert policy.count(Push("b", 0, "worker-1", None, _dense(store, 4))).step == 1
    assert np.array_equal(_value(store), np.full(4, -3, np.float32))  # mean of 2 and 4
    stale = policy.admit(0)
    assert stale is not None
    assert "stale" in stale.reason
    assert policy.admit(1) is None


def test_sync_applies_the_step_when_the_chief_drops_the_missing_worker(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.SYNC))
    store.policy.count(Push("a", 0, "worker-0", None, _dense(store, 2)))
    assert store.step == 0
    store.policy.set_workers(["worker-0"])
    assert store.step == 1
    assert np.array_equal(_value(store), np.full(4, -2, np.float32))


def test_sync_with_replicas_to_aggregate_counts_the_first_gradients_only(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.SYNC, replicas_to_aggregate=1))
    assert store.policy.count(Push("a", 0, "worker-1", None, _dense(store, 2))).step == 1
    late = store.policy.count(Push("b", 0, "worker-0", None, _dense(store, 8)))
    assert not late.accepted  # a backup worker's gradient
    assert "stale" in late.reason
    assert np.array_equal(_value(store), np.full(4, -2, np.float32))


def test_sync_a_worker_whose_batch_this_ps_applied_completes_the_step_adding_nothing(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.SYNC))
    policy = store.policy
    policy.count(Push("a", 0, "worker-0", None, _dense(store, 2)))
    policy.count_applied("worker-1", 0)  # its batch was applied here before (another holder's)
    assert store.step == 1
    assert np.array_equal(_value(store), np.full(4, -2, np.float32))  # 2 alone, not (2 + 0) / 2
    policy.count_applied("worker-0", 0)  # of a step that is closed: nothing
    policy.count_applied("", 1)  # from no worker: nothing
    assert policy.awaiting() == 2
    policy.count_applied("worker-0", 1)
    policy.count_applied("worker-0", 1)  # once a worker a step
    assert policy.awaiting() == 1
    assert policy.count(Push("b", 1, "worker-1", None, _dense(store, 4))).step == 2
    assert np.array_equal(_value(store), np.full(4, -6, np.float32))
    policy.count_applied("worker-0", 2)
    policy.count_applied("worker-1", 2)  # no gradient at all: the step moves, nothing applied
    assert store.step == 3
    assert np.array_equal(_value(store), np.full(4, -6, np.float32))


def test_async_a_batch_applied_before_counts_no_step(store: ParameterStore) -> None:
    _init(store, Mode(kind=ps_pb2.ASYNC))
    store.policy.count_applied("worker-0", 0)
    assert store.step == 0


def test_sync_a_push_without_gradients_counts_but_is_not_in_the_mean(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.SYNC))
    policy = store.policy
    # worker-0 has no batch this step (the data epoch is ending): it pushes nothing dense
    assert policy.count(Push("a", 0, "worker-0", None, {})).accepted
    assert policy.awaiting() == 1
    assert policy.count(Push("b", 0, "worker-1", None, _dense(store, 4))).step == 1
    assert np.array_equal(_value(store), np.full(4, -4, np.float32))  # 4 / 1, not 4 / 2
    policy.count(Push("c", 1, "worker-0", None, {}))
    assert policy.count(Push("d", 1, "worker-1", None, {})).step == 2  # none brought any
    assert np.array_equal(_value(store), np.full(4, -4, np.float32))


def test_sync_a_worker_that_joins_mid_step_is_waited_for_from_the_next_step(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.SYNC))
    policy = store.policy
    policy.count(Push("a", 0, "worker-0", None, _dense(store, 2)))
    policy.set_workers([*WORKERS, "worker-2"])
    assert store.step == 0
    assert policy.awaiting() == 1  # this step: worker-1 only
    assert policy.count(Push("b", 0, "worker-1", None, _dense(store, 4))).step == 1
    assert np.array_equal(_value(store), np.full(4, -3, np.float32))
    assert policy.awaiting() == 3  # from the next step on: worker-2 too
    policy.count(Push("c", 1, "worker-0", None, _dense(store, 0)))
    policy.count(Push("d", 1, "worker-1", None, _dense(store, 0)))
    assert store.step == 1
    assert policy.count(Push("e", 1, "worker-2", None, _dense(store, 0))).step == 2


def test_sync_a_worker_that_joins_between_steps_is_waited_for_at_once(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.SYNC))
    store.policy.set_workers([*WORKERS, "worker-2"])
    assert store.policy.awaiting() == 3


def test_sync_a_worker_leaving_as_another_joins_mid_step_is_dropped_at_once(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.SYNC))
    store.policy.count(Push("a", 0, "worker-0", None, _dense(store, 2)))
    store.policy.set_workers(["worker-0", "worker-2"])  # worker-1 left, worker-2 joined
    assert store.step == 1  # worker-0's gradient was all the step waited for
    assert np.array_equal(_value(store), np.full(4, -2, np.float32))
    assert store.policy.awaiting() == 2


def test_bounded_staleness_a_joining_worker_does_not_hold_the_others_back(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.BOUNDED_STALENESS, max_staleness=0))
    for i in range(2):
        _async_push(store, "worker-0", f"a{i}")
        _async_push(store, "worker-1", f"b{i}")
    store.policy.set_workers([*WORKERS, "worker-2"])  # it starts level with the slowest
    released = threading.Event()

    def read() -> None:
        store.policy.before_read("worker-0", is_active=lambda: True)
        released.set()

    first = threading.Thread(target=read, daemon=True)  # a failure leaves no thread behind
    first.start()
    assert released.wait(30)  # two pushes ahead of worker-2's none: not held
    first.join()
    # From now on worker-2 counts as any other: one push ahead of it is too far
    _async_push(store, "worker-0", "a2")
    _async_push(store, "worker-1", "b2")
    released.clear()
    second = threading.Thread(target=read, daemon=True)
    second.start()
    assert not released.wait(0.5)
    _async_push(store, "worker-2", "c0")
    assert released.wait(30)
    second.join()


def test_bounded_staleness_a_worker_joining_as_the_slowest_leaves_holds_nobody_back(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.BOUNDED_STALENESS, max_staleness=0))
    for i in range(3):
        _async_push(store, "worker-0", f"a{i}")  # worker-1 never pushed: it died
    store.policy.set_workers(["worker-0", "worker-2"])  # worker-2 replaces it
    deadline = time.monotonic() + 2
    store.policy.before_read("worker-0", is_active=lambda: time.monotonic() < deadline)


# --- nothing non-finite is stored -------------------------------------------------------------

HUGE = OptimizerConfig("sgd", {"learning_rate": 1e30})  # 1e30 * 1e10 overflows float32


def _init_with(store: ParameterStore, optimizer: OptimizerConfig, mode: Mode) -> None:
    store.init(epoch=1, specs=[SPEC], optimizer=optimizer, step=0, mode=mode, workers=WORKERS)
    store.assign("w", np.zeros(4, np.float32)).result()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "minus-inf"])
def test_finite_finds_a_nan_or_an_inf_anywhere(dtype: str, bad: float) -> None:
    array = np.ones((3, 5), streams.dtype_of(dtype))
    assert finite(array)
    array[2, 4] = bad
    assert not finite(array)


def test_integers_and_empty_arrays_are_finite() -> None:
    assert finite(np.arange(5, dtype=np.int64))
    assert finite(np.zeros((0, 3), np.float32))


def test_an_update_that_is_not_finite_leaves_the_shard_and_its_state_as_they_were(
    store: ParameterStore,
) -> None:
    momentum = OptimizerConfig("sgd", {"learning_rate": 1e30, "momentum": 0.9})
    _init_with(store, momentum, Mode(kind=ps_pb2.ASYNC))
    before = store.snapshot_at(0, is_active=lambda: True)
    held = store.shards.held("w", where="test")
    with pytest.raises(PsError) as caught:
        store.apply_dense(held, np.full(4, 1e10, np.float32), push_id="p", who="by w-0").result()
    assert caught.value.reason == NONFINITE_UPDATE
    assert "the update is not finite" in caught.value.message
    assert "'w'" in caught.value.message
    assert "by w-0" in caught.value.message
    after = store.snapshot_at(0, is_active=lambda: True)
    assert np.array_equal(after.values["w"], before.values["w"])
    for old, new in zip(
        jax.tree_util.tree_leaves(before.states["w"]),
        jax.tree_util.tree_leaves(after.states["w"]),
        strict=True,
    ):
        assert np.array_equal(old, new)
    assert store.updates.already_applied("p") == set()  # a retry would try the shard again


def test_gradient_rows_whose_update_is_not_finite_are_not_written(store: ParameterStore) -> None:
    _init_with(store, HUGE, Mode(kind=ps_pb2.ASYNC))
    held = store.shards.held("w", where="test")
    with pytest.raises(PsError) as caught:
        store.updates.sparse(
            held, np.array([1]), np.full((1,), 1e10, np.float32), push_id=""
        ).result()
    assert caught.value.reason == NONFINITE_UPDATE
    assert np.array_equal(_value(store), np.zeros(4, np.float32))


def test_sync_opens_the_next_step_when_the_update_of_its_mean_is_refused(
    store: ParameterStore,
) -> None:
    _init_with(store, HUGE, Mode(kind=ps_pb2.SYNC))
    policy = store.policy
    policy.count(Push("a", 0, "worker-0", None, _dense(store, 1e10)))
    store.settle([])  # nothing pending: no error
    with pytest.raises(PsError) as caught:
        policy.count(Push("b", 0, "worker-1", None, _dense(store, 1e10)))
    assert caught.value.reason == NONFINITE_UPDATE
    assert "the mean of step 0 from worker-0, worker-1" in caught.value.message
    assert store.step == 1  # the step is not held shut
    assert np.array_equal(_value(store), np.zeros(4, np.float32))
    assert store.counters.snapshot()["refused_nonfinite_update"] == 1
    policy.count(Push("c", 1, "worker-0", None, _dense(store, 0)))
    assert policy.count(Push("d", 1, "worker-1", None, _dense(store, 0))).step == 2


def test_sync_dropping_a_worker_applies_the_step_even_when_its_update_is_refused(
    store: ParameterStore,
) -> None:
    _init_with(store, HUGE, Mode(kind=ps_pb2.SYNC))
    store.policy.count(Push("a", 0, "worker-0", None, _dense(store, 1e10)))
    store.policy.set_workers(["worker-0"])  # the refusal is logged, not raised to the chief
    assert store.step == 1
    assert np.array_equal(_value(store), np.zeros(4, np.float32))


@pytest.mark.parametrize(
    "kind", [ps_pb2.ASYNC, ps_pb2.BOUNDED_STALENESS, ps_pb2.SYNC], ids=["async", "bounded", "sync"]
)
def test_every_mode_finds_a_push_for_a_step_the_ps_has_not_reached_wrong(
    store: ParameterStore, kind: ps_pb2.TrainingMode
) -> None:
    _init(store, Mode(kind=kind, max_staleness=1))
    assert store.policy.step_problem(0) is None
    for step in (1, 2**62):
        problem = store.policy.step_problem(step)
        assert problem is not None
        assert f"step {step} is ahead of this ps (at step 0)" in problem
    assert "negative" in (store.policy.step_problem(-1) or "")


def test_async_allows_a_stale_step_sync_leaves_it_to_its_stale_refusal(
    store: ParameterStore,
) -> None:
    _init(store, Mode(kind=ps_pb2.ASYNC))
    assert _async_push(store, "worker-0", "p1")
    assert store.policy.step_problem(0) is None  # one behind: staleness, not a problem
    _init(store, Mode(kind=ps_pb2.SYNC), workers=("worker-0",))
    store.policy.count(Push("", 0, "worker-0", None, _dense(store, 1.0)))
    assert store.step == 1
    assert store.policy.step_problem(0) is None
    assert store.policy.admit(0) is not None  # refused as stale, in the reply
    assert "sync takes gradients of the current step 1 only" in (store.policy.step_problem(2) or "")


def test_a_read_may_wait_for_any_step_up_to_the_last_one_only() -> None:
    mode = Mode(last_step=100)
    assert mode.read_step_problem(0) is None
    assert mode.read_step_problem(100) is None
    assert "past the last step 100" in (mode.read_step_problem(101) or "")
    assert "negative" in (mode.read_step_problem(-5) or "")
    assert Mode().read_step_problem(2**62) is None  # no last step: any step may come


def test_init_declares_which_shards_are_updated_by_rows(store: ParameterStore) -> None:
    table = Spec("e", (8, 2), np.dtype(np.float32))
    store.init(epoch=1, specs=[SPEC, table], optimizer=SGD, step=0, by_rows={"e"})
    assert store.shards.held("e", where="test").by_rows is True
    assert store.shards.held("w", where="test").by_rows is False
    store.init(epoch=2, specs=[SPEC, table], optimizer=SGD, step=0)
    assert store.shards.held("e", where="test").by_rows is None  # nothing declared: either kind


def test_an_unknown_shard_is_an_invalid_argument_naming_it(store: ParameterStore) -> None:
    _init(store, Mode())
    with pytest.raises(PsError, match="holds no shard 'nope'") as caught:
        store.shards.held("nope", where="Update.tensors[0]")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_save_may_wait_for_the_last_step_and_no_further() -> None:
    mode = Mode(last_step=100)
    assert mode.read_step_problem(100, what="step") is None
    assert (mode.read_step_problem(101, what="step") or "").startswith("step 101 is past")
