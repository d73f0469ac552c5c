"""A dynamic embedding table's part on one ps (`ps.dynamic`): ownership by a mixing hash,
initial rows that are a function of (seed, table, id), admission by count or by a draw of
(id, count), continuous LRU/LFU eviction within max_rows, optimizer state created, evicted and
checkpointed with its row, restore onto fewer or more ps, decisions that replay the same."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from jaxps_runtime.ps import dynamic
from jaxps_runtime.ps.dynamic import Spec, Table
from jaxps_runtime.wire import tables

INT64 = np.iinfo(np.int64)
EDGES = np.array([0, 1, -1, -2, INT64.min, INT64.max, 2**32, -(2**40)], np.int64)


def table(**kw: object) -> Table:
    spec = {"name": "items", "dim": 4, "max_rows": 8, **kw}
    return Table(Spec(**spec), optax.sgd(1.0))  # type: ignore[arg-type]


def push(t: Table, step: int, ids: list[int], grad: float = 1.0) -> None:
    """One push of `ids` (a batch: repeats are occurrences), each row's gradient `grad`."""
    unique, counts, _ = tables.dedup(np.array(ids, np.int64))
    t.push(step, unique, counts, np.full((unique.size, t.spec.dim), grad, np.float32))


def test_ownership_mixes_the_id_and_is_fixed() -> None:
    # golden: a change of the mixer or its salt would move every row of a restored job
    assert dynamic.owner(EDGES, 3).tolist() == dynamic.owner(EDGES.copy(), 3).tolist()
    assert set(dynamic.owner(EDGES, 1).tolist()) == {0}
    assert dynamic.mix64(np.array([0], np.uint64))[0] == np.uint64(0xE220A8397B1DCDAF)
    # ids a hash or a counter makes (all even, or sequential) spread over the ps, unlike id % n
    for ids in (np.arange(0, 200_000, 2, dtype=np.int64), np.arange(100_000, dtype=np.int64)):
        for n in (2, 3):
            share = np.bincount(dynamic.owner(ids, n), minlength=n) / ids.size
            assert np.all(np.abs(share - 1 / n) < 0.01), (n, share)
    assert np.bincount(np.arange(0, 200_000, 2) % 2, minlength=2)[1] == 0  # what % would do


def test_an_ids_initial_row_is_a_function_of_seed_table_and_id_alone() -> None:
    salt = dynamic.table_salt(7, "items")
    rows = dynamic.initial_rows(EDGES, dim=16, salt=salt, scale=0.05)
    shuffled = EDGES[::-1].copy()
    again = dynamic.initial_rows(shuffled, dim=16, salt=salt, scale=0.05)
    assert np.array_equal(rows, again[::-1])  # order and batch do not matter: bitwise
    assert rows.dtype == np.float32
    assert np.all(np.abs(rows) <= 0.05)
    assert len({r.tobytes() for r in rows}) == EDGES.size  # distinct ids, distinct rows
    other = dynamic.initial_rows(EDGES, dim=16, salt=dynamic.table_salt(7, "users"), scale=0.05)
    reseeded = dynamic.initial_rows(EDGES, dim=16, salt=dynamic.table_salt(8, "items"), scale=0.05)
    assert not np.array_equal(rows, other)
    assert not np.array_equal(rows, reseeded)
    many = dynamic.initial_rows(np.arange(20_000), dim=8, salt=salt, scale=1.0)
    assert abs(float(many.mean())) < 0.01
    assert abs(float(many.std()) - 1 / np.sqrt(3)) < 0.01  # uniform on [-1, 1)


def test_an_id_is_admitted_at_its_min_count_reading_its_initial_value_until_then() -> None:
    t = table(min_count=3)
    x = np.array([42], np.int64)
    before = t.pull(x)
    push(t, 1, [42])
    push(t, 2, [42])
    assert t.resident == 0
    assert np.array_equal(t.pull(x), before)  # no state, its gradients dropped
    assert t.counters.dropped == 2
    push(t, 3, [42], grad=0.5)  # the third occurrence: admitted, then updated
    assert t.resident == 1
    assert t.counters.admitted == 1
    np.testing.assert_allclose(t.pull(x), before - 0.5)
    # occurrences in one batch count as many
    u = table(min_count=3)
    push(u, 1, [5, 5, 5])
    assert u.resident == 1


def test_admission_by_probability_is_a_draw_of_the_id_and_its_count() -> None:
    ids = list(range(1000))
    a, b = table(probability=0.25, max_rows=2000), table(probability=0.25, max_rows=2000)
    for t in (a, b):
        push(t, 1, ids)
    assert a.ids().tolist() == b.ids().tolist()  # the same pushes, the same decisions
    assert 200 < a.resident < 300, a.resident


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_resident_rows_never_pass_max_rows_and_the_policy_picks_the_victim(policy: str) -> None:
    t = table(max_rows=4, eviction=policy)
    push(t, 1, [1])
    push(t, 2, [2, 2, 2])
    push(t, 3, [3])
    push(t, 4, [4, 4])
    push(t, 5, [1, 1, 1, 1])  # id 1: the oldest update, but now the most frequent
    push(t, 6, [5])
    assert t.resident == 4
    assert t.counters.evicted == 1
    gone = {1, 2, 3, 4, 5} - set(t.ids().tolist())
    assert gone == ({2} if policy == "lru" else {3}), (policy, t.ids().tolist())
    rng = np.random.default_rng(0)
    for step in range(7, 200):  # a stream of mostly new ids: the bound holds at every step
        push(t, step, rng.integers(INT64.min, INT64.max, 3, dtype=np.int64).tolist())
        assert t.resident <= 4


def test_a_row_given_to_another_id_starts_from_fresh_state_and_its_own_initial_value() -> None:
    t = Table(Spec(name="items", dim=2, max_rows=2), optax.adagrad(0.1))
    push(t, 1, [1])
    push(t, 2, [2])
    accumulators = [leaf for leaf in _leaves(t) if leaf.shape == (2, 2)]
    assert accumulators
    assert all(np.all(a > 0.1) for a in accumulators)
    push(t, 3, [3])  # evicts id 1 (least recent)
    assert t.row_of(1) == -1
    row = t.row_of(3)
    fresh = Table(Spec(name="items", dim=2, max_rows=2), optax.adagrad(0.1))
    push(fresh, 1, [3])
    for used, new in zip(_leaves(t), _leaves(fresh), strict=True):
        if used.shape == (2, 2):  # the state of id 3 as if its row had never been another's
            np.testing.assert_allclose(used[row], new[fresh.row_of(3)])
    np.testing.assert_allclose(t.pull(np.array([3])), fresh.pull(np.array([3])))


def test_ids_a_push_admits_past_every_row_wait_on_probation_with_their_counts() -> None:
    t = table(max_rows=2, min_count=2)
    push(t, 1, [1, 1, 2, 2, 3, 3])  # three admitted at once, rows for two, none to evict
    assert t.resident == 2
    assert t.probation() == {3: (2, 1)}
    push(t, 2, [3])  # counted on: admitted, the least recent row evicted
    assert t.row_of(3) >= 0
    assert t.resident == 2


def test_a_gradient_for_an_evicted_id_never_lands_in_the_row_it_had() -> None:
    t = table(max_rows=2, min_count=2)
    push(t, 1, [1, 1])
    push(t, 2, [2, 2])
    pulled = t.pull(np.array([1]))  # a worker holds id 1's row...
    push(t, 3, [3, 3])  # ...id 3 is admitted into id 1's row meanwhile
    three = t.pull(np.array([3]))
    push(t, 4, [1])  # id 1's gradient: on probation again, dropped
    assert t.row_of(1) == -1
    assert np.array_equal(t.pull(np.array([3])), three)
    assert t.counters.dropped == 1
    assert pulled.shape == (1, 4)


def test_the_same_pushes_make_the_same_table_bit_for_bit() -> None:
    def run() -> dict[str, np.ndarray]:
        t = Table(Spec(name="items", dim=4, max_rows=64, min_count=2), optax.adam(0.01))
        rng = np.random.default_rng(1)
        for step in range(1, 60):
            push(t, step, rng.integers(0, 200, 32).tolist(), grad=float(step % 3) - 1)
        return t.snapshot()

    first, second = run(), run()
    assert first.keys() == second.keys()
    for key in first:
        assert np.array_equal(first[key], second[key]), key


@pytest.mark.parametrize(("old", "new"), [(2, 1), (2, 3), (1, 2)])
def test_a_snapshot_restores_onto_fewer_or_more_ps_by_the_hash(old: int, new: int) -> None:
    spec = Spec(name="items", dim=4, max_rows=2000, min_count=2, seed=3)
    before = [Table(spec, optax.adam(0.01)) for _ in range(old)]
    rng = np.random.default_rng(2)
    for step in range(1, 40):
        ids = rng.integers(-1000, 1000, 64, dtype=np.int64)
        unique, counts, _ = tables.dedup(ids)
        for ps, where in tables.split(unique, old):
            grads = np.full((where.size, 4), 0.1 * step, np.float32)
            before[ps].push(step, unique[where], counts[where], grads)
    snapshots = [t.snapshot() for t in before]
    after = [Table(spec, optax.adam(0.01)) for _ in range(new)]
    for ps, t in enumerate(after):
        t.restore(snapshots, ps=ps, num_ps=new)
        assert all(dynamic.owner(t.ids(), new) == ps)
    keys = np.concatenate([s["keys"] for s in snapshots])
    assert sorted(keys.tolist()) == sorted(k for t in after for k in t.ids().tolist())
    values = {
        k: v.tobytes() for s in snapshots for k, v in zip(s["keys"], s["values"], strict=True)
    }
    for t in after:
        ids = t.ids()
        for key, row in zip(ids.tolist(), t.pull(ids), strict=True):
            assert row.tobytes() == values[key]
    waiting = sorted(k for s in snapshots for k in s["probation/keys"].tolist())
    assert waiting == sorted(k for t in after for k in t.probation())
    # the optimizer state came with its rows: one more identical push, identical results
    probe = np.array(sorted(keys.tolist())[:5], np.int64)
    outcomes = []
    for parts, n in ((before, old), (after, new)):
        for ps, where in tables.split(probe, n):
            parts[ps].push(
                99,
                probe[where],
                np.ones(where.size, np.int64),
                np.ones((where.size, 4), np.float32),
            )
        outcomes.append(
            np.concatenate([parts[ps].pull(probe[w]) for ps, w in tables.split(probe, n)])
        )
    order = [
        np.argsort(np.concatenate([probe[w] for _, w in tables.split(probe, n)]))
        for n in (old, new)
    ]
    np.testing.assert_array_equal(outcomes[0][order[0]], outcomes[1][order[1]])


def test_a_restore_past_max_rows_keeps_the_rows_updated_last() -> None:
    t = table(max_rows=16)
    for step, key in enumerate(range(100, 116), start=1):
        push(t, step, [key])
    small = table(max_rows=4)
    small.restore([t.snapshot()], ps=0, num_ps=1)
    assert small.ids().tolist() == [112, 113, 114, 115]
    assert small.counters.evicted == 12


def test_a_bad_table_is_refused_naming_each_field() -> None:
    with pytest.raises(ValueError, match="dim: 0 is not at least 1") as err:
        Spec(name="items", dim=0, max_rows=0, min_count=0, probability=2.0, eviction="fifo")  # type: ignore[arg-type]
    for field in ("maxRows: 0", "admission.minCount: 0", "admission.probability: 2.0", "'fifo'"):
        assert field in str(err.value)


def _leaves(t: Table) -> list[np.ndarray]:
    import jax

    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(t.state)]


def test_keyed_finds_adds_and_removes_whole_arrays() -> None:
    k = dynamic.Keyed(["row"])
    k.add(np.array([5, -3, 9], np.int64), row=np.array([0, 1, 2]))
    k.add(np.array([7], np.int64), row=np.array([3]))
    assert k.keys.tolist() == [-3, 5, 7, 9]
    assert k.get(np.array([9, 4, -3, 7], np.int64), "row").tolist() == [2, -1, 1, 3]
    k.remove(np.array([5, 100], np.int64))
    assert k.keys.tolist() == [-3, 7, 9]
    assert k.columns["row"].tolist() == [1, 3, 2]
    assert len(k) == 3


@pytest.mark.parametrize("n", [0, 1, 3, 5, 8])
def test_smallest_is_the_head_of_a_full_sort_with_ties_broken_by_the_next_order(n: int) -> None:
    rng = np.random.default_rng(n)
    first, second = rng.integers(0, 3, 40), rng.permutation(40)
    expected = np.lexsort((second, first))[:n]
    assert sorted(dynamic.smallest(n, first, second).tolist()) == sorted(expected.tolist())


def test_the_probation_stays_bounded_forgetting_the_least_recently_counted() -> None:
    t = table(max_rows=16, min_count=3)
    for step in range(1, 40):
        ids = np.arange(step * 10, step * 10 + 10, dtype=np.int64)
        t.push(step, ids, np.ones(10, np.int64), np.zeros((10, 4), np.float32))
        assert len(t.probation()) <= dynamic.PROBATION_PER_ROW * 16
    waiting = t.probation()
    assert min(s for _, s in waiting.values()) > 30  # the oldest forgotten first
    assert t.resident == 0  # none seen three times
