"""A dynamic embedding table's part on one ps: rows keyed by any 64-bit id, admitted by count,
evicted within a bound, each row's optimizer state kept, created and evicted with it.

What a fixed table `[0, rows)` cannot do (research/embeddings.md): recommendation ids are
hashes over the whole int64 space, most seen once, and a table must stay within memory while
new ids keep arriving. This is the ps's side, pure numpy and optax, with no wire and no lock
of its own: the ps calls `pull` from its gRPC threads and `push` from its one applier thread
(so every write is serial and in push order), under its store's lock.

- **Who owns an id**: `owner(ids, num_ps)`, a fixed 64-bit mixer (splitmix64's finalizer) of
  the id with a salt, modulo the ps count; never `id % n`, which puts real ids' low bits (often
  equal: hashed to even numbers, sequential) on one ps, nor Python's `hash` (`hash(-1) ==
  hash(-2)`).
- **Initial value = f(seed, table, id)**: `initial_rows`, counter-based from the same mixer,
  so the same id reads the same vector on every task, after any restore, until its first
  update (TFRA draws afresh on each lookup, Monolith per thread, DeepRec per id % 4096).
- **Admission**: an id becomes a row once the pushes that carried it have counted `min_count`
  occurrences (exact counts on probation, themselves bounded: the least recently counted are
  forgotten first), or, with `probability` < 1, when a draw that is a function of (id, count)
  says so. An id not admitted reads its initial value and its gradient is dropped (counted):
  its value before admission is the row's value at admission.
- **Eviction, continuous**: resident rows never exceed `max_rows`. When a push admits more
  than the free rows, the rows it does not touch are evicted by `eviction` (`lru`: least
  recently updated step first; `lfu`: fewest occurrences first, then least recent), ties by
  id, in chunks (`EVICT_CHUNK` of the table) so the ordering is paid rarely. Decisions are
  functions of the pushes applied, in order: a replayed push decides the same.
- **Optimizer state lives with its row**: every optax leaf shaped like the table is a row of
  the same index, reset to `tx.init`'s row on admission (adagrad starts at 0.1, not 0), and
  snapshotted and restored with it. Leaves not shaped like the table (adam's step count) are
  the table's, as in jaxps's fixed sparse tables.
- **Snapshot and restore**: `snapshot` gives every array at one point (keys, values, each state
  leaf, last step, counts, the probation); `restore` takes the snapshots of any number of ps
  and keeps the ids this ps owns under the new ps count, so a job restored onto more or fewer
  ps re-partitions by the hash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import jax
import numpy as np
import optax

from jaxps_runtime.ps.optim import Applier
from jaxps_runtime.wire.tables import (
    ADMIT_SALT,
    Eviction,
    Spec,
    bits,
    initial_rows,
    mix64,
    owner,
    table_salt,
)

__all__ = [
    "Eviction",
    "Spec",
    "Table",
    "initial_rows",
    "merged",
    "mix64",
    "owner",
    "repartition",
    "table_salt",
]

EVICT_CHUNK = 1 / 16
"""When a push needs rows, at least this share of the table is evicted at once: the ordering
of the resident rows (a sort) is then paid once per so many admissions, not on each."""
PROBATION_PER_ROW = 4
"""Ids counted on probation, at most, per row of the table (the least recently counted are
forgotten past it): the admission state is bounded too."""


@dataclasses.dataclass
class Counters:
    """What the table did, since it started (restored tables start again from 0)."""

    lookups: int = 0  # ids pulled
    hits: int = 0  # of those, resident
    admitted: int = 0
    evicted: int = 0
    dropped: int = 0  # gradients of ids not (or no longer) admitted


class Keyed:
    """int64 keys kept sorted, each with int64 columns beside it: found, added and removed for
    whole arrays at once (a binary search per key, one O(n) copy per change). What a dict of
    Python ints costs per id (about 100 bytes and a Python call) this costs in 8 bytes a
    column and a numpy pass; a push of thousands of new ids is one search, one insert."""

    def __init__(self, columns: Sequence[str], dtype: type[np.integer[Any]] = np.int64) -> None:
        """`dtype`: the columns' (a table's rows fit an int32: half the bytes moved)."""
        self.keys = np.zeros(0, np.int64)
        self.columns = {name: np.zeros(0, dtype) for name in columns}

    def __len__(self) -> int:
        return int(self.keys.size)

    def positions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each of `ids` is, and whether it is there at all."""
        pos = np.searchsorted(self.keys, ids)
        found = pos < self.keys.size
        found[found] = self.keys[pos[found]] == ids[found]
        return pos, found

    def get(self, ids: np.ndarray, column: str, missing: int = -1) -> np.ndarray:
        """`column` of each of `ids`, `missing` where absent."""
        pos, found = self.positions(ids)
        out = np.full(ids.size, missing, np.int64)
        out[found] = self.columns[column][pos[found]]
        return out

    def add(self, ids: np.ndarray, **values: np.ndarray) -> None:
        """Adds `ids` (none present, each once) with their columns' values."""
        if not ids.size:
            return
        order = np.argsort(ids, kind="stable")
        new = ids[order]
        # where the new keys land in the merged array: after the old keys below them and the
        # new ones before them (one pass each, no sort of the whole)
        at = np.searchsorted(self.keys, new) + np.arange(new.size)
        old = np.ones(self.keys.size + new.size, bool)
        old[at] = False

        def merged(column: np.ndarray, added: np.ndarray) -> np.ndarray:
            out = np.empty(old.size, column.dtype)
            out[old] = column
            out[at] = added
            return out

        self.keys = merged(self.keys, new)
        for name, column in self.columns.items():
            self.columns[name] = merged(column, np.asarray(values[name])[order])

    def remove_at(self, positions: np.ndarray) -> None:
        if not positions.size:
            return
        self.keys = np.delete(self.keys, positions)
        for name, column in self.columns.items():
            self.columns[name] = np.delete(column, positions)

    def remove(self, ids: np.ndarray) -> None:
        pos, found = self.positions(ids)
        self.remove_at(pos[found])


def smallest(n: int, *orders: np.ndarray) -> np.ndarray:
    """The indices of the `n` smallest entries by `orders` (the first decides, the next ones
    break its ties), in no particular order: a partition, and a sort of the ties at the
    boundary only. Deterministic: equal inputs, equal choice."""
    size = orders[0].size
    if n >= size:
        return np.arange(size)
    if n <= 0:
        return np.zeros(0, np.int64)
    first = orders[0]
    bound = np.partition(first, n - 1)[n - 1]
    below = np.flatnonzero(first < bound)
    ties = np.flatnonzero(first == bound)
    need = n - below.size
    if len(orders) > 1 and ties.size > need:
        ties = ties[smallest(need, *(o[ties] for o in orders[1:]))]
    return np.concatenate([below, ties[:need]])


class Table:
    """One dynamic table's rows on one ps. Not thread-safe: the ps serialises `push` (its
    applier thread) against `pull` and `snapshot` (its store's lock).

    Rows are slots of preallocated arrays (`values`, the optimizer's row-shaped leaves,
    `keys`, `last`, `count`); `index` maps ids to slots and `free` holds the slots not in use
    (a stack: slot 0 is used first); `waiting` holds the ids on probation (their occurrences
    and the step they were last counted at)."""

    def __init__(
        self,
        spec: Spec,
        tx: optax.GradientTransformation,
        *,
        ps: int = 0,
        num_ps: int = 1,
        applier: Applier | None = None,
    ) -> None:
        """`applier`: `tx`'s jitted updates, shared with the ps's other shards of the same
        optimizer (each jit compiles once per row count: per table, a job of many small
        tables would compile as many times again)."""
        self.spec = spec
        self.ps, self.num_ps = ps, num_ps  # which part of the job's table this is
        self.applier = applier or Applier(tx)
        self.salt = table_salt(spec.seed, spec.name)
        cap, dim = spec.max_rows, spec.dim
        self.values = np.zeros((cap, dim), np.float32)
        self.state = _host(tx.init(self.values), self.values.shape)
        fresh = tx.init(np.zeros((1, dim), np.float32))
        # each row-shaped leaf's value for a new row (its other leaves: None)
        self.fresh = jax.tree_util.tree_map(
            lambda leaf, new: np.asarray(new)[0] if np.shape(leaf) == (cap, dim) else None,
            self.state,
            fresh,
        )
        self.keys = np.zeros(cap, np.int64)
        self.last = np.zeros(cap, np.int64)  # the step of the row's last update
        self.count = np.zeros(cap, np.int64)  # occurrences applied, admission's included
        self.used = np.zeros(cap, bool)
        self.index = Keyed(["row"], np.int32)  # id -> slot
        self.free = np.arange(cap - 1, -1, -1, dtype=np.int64)  # the first `n_free` are free
        self.n_free = cap
        self.waiting = Keyed(["count", "step"])  # ids seen but not admitted
        self.counters = Counters()

    @property
    def resident(self) -> int:
        return len(self.index)

    def ids(self) -> np.ndarray:
        """The resident ids, sorted."""
        return self.index.keys.copy()

    def row_of(self, key: int) -> int:
        """The slot of id `key` (-1: not resident)."""
        return int(self._rows(np.array([key], np.int64))[0])

    def probation(self) -> dict[int, tuple[int, int]]:
        """The ids on probation: id -> (occurrences, the step last counted)."""
        w = self.waiting
        return {
            int(k): (int(c), int(s))
            for k, c, s in zip(w.keys, w.columns["count"], w.columns["step"], strict=True)
        }

    # --- reads ----------------------------------------------------------------------------

    def resident_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of `ids` (any int64, repeats allowed), which are resident, and their rows (in the
        order of `ids`): what a Read sends; the others read their initial value, which the
        reader computes itself (`initial_rows`). Counts lookups and hits, as `pull`."""
        ids = np.asarray(ids, np.int64)
        rows = self._rows(ids)
        here = rows >= 0
        self.counters.lookups += int(ids.size)
        self.counters.hits += int(here.sum())
        return here, self.values[rows[here]]

    def pull(self, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` (any int64, repeats allowed): resident ones as they are, the others
        their initial value. Counts lookups and hits; changes nothing else (eviction orders by
        updates only, so reads, retried or not, never change what is evicted)."""
        ids = np.asarray(ids, np.int64)
        here, resident = self.resident_rows(ids)
        out = np.empty((ids.size, self.spec.dim), np.float32)
        out[here] = resident
        if not here.all():
            out[~here] = self._initial(ids[~here])
        return out

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        return self.index.get(ids, "row")

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        return initial_rows(ids, dim=self.spec.dim, salt=self.salt, scale=self.spec.scale)

    # --- the applier's writes -------------------------------------------------------------

    def push(
        self,
        step: int,
        ids: np.ndarray,
        counts: np.ndarray,
        grads: np.ndarray,
        *,
        lock: AbstractContextManager[Any] | None = None,
    ) -> bool:
        """Applies one push: `ids` unique, `counts` their occurrences in the batch (>= 0),
        `grads` their gradient rows. Admits what reached admission (evicting if it must), then
        updates every resident id's row and state; drops the gradients of the others. False
        (and no row updated, admissions kept) when the new rows would not be finite.

        `lock` (the store's) is held while the table changes (admission, then the rows'
        write), not while the optimizer computes the new rows: readers (`pull`, `snapshot`,
        under the same lock) see the rows before or after the update, never half of one, and
        are not held up by it. Only the one thread that pushes may change the table."""
        if ids.size == 0:
            return True
        with lock or nullcontext():
            rows = self._rows(ids)
            missing = np.flatnonzero(rows < 0)
            admitted, seen = self._admitted(ids[missing], counts[missing], step)
            if admitted.size:
                where = missing[admitted]  # the admitted ids' places in `ids`
                placed, slots = self._place(ids[where], protect=rows[rows >= 0])
                rows[where[:placed]] = slots
                self.counters.admitted += placed
                # no row even after eviction: they wait on probation with their counts
                self.waiting.add(
                    ids[where[placed:]],
                    count=seen[placed:],
                    step=np.full(where.size - placed, step),
                )
            here = rows >= 0
            self.counters.dropped += int((~here).sum())
        if not here.any():
            return True
        rows, grads = rows[here], grads[here]
        new_rows, new_state = self.applier.sparse_rows(self.values, self.state, rows, grads)
        if not np.isfinite(new_rows).all():
            return False
        with lock or nullcontext():
            self.state = self.applier.scatter(self.values, self.state, rows, new_rows, new_state)
            self.last[rows] = step
            self.count[rows] += counts[here]
        return True

    def _admitted(
        self, ids: np.ndarray, counts: np.ndarray, step: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Of ids not resident, the positions (in `ids`) of those admitted by this push
        (counted on probation first), and the occurrences each was admitted with."""
        spec = self.spec
        if not ids.size:
            return np.zeros(0, np.int64), counts
        seen = counts.astype(np.int64)
        if len(self.waiting):
            pos, found = self.waiting.positions(ids)
            seen[found] += self.waiting.columns["count"][pos[found]]
            self.waiting.remove_at(pos[found])
        admit = seen >= spec.min_count
        if spec.probability < 1:
            admit &= self._draws(ids, seen) < spec.probability
        wait = ~admit
        if wait.any():
            self.waiting.add(ids[wait], count=seen[wait], step=np.full(int(wait.sum()), step))
            limit = PROBATION_PER_ROW * spec.max_rows
            if len(self.waiting) > limit:  # forget the least recently counted (then by id)
                w = self.waiting
                extra = len(w) - limit + int(limit * EVICT_CHUNK)
                w.remove_at(np.sort(smallest(extra, w.columns["step"], w.keys)))
        return np.flatnonzero(admit), seen[admit]

    def _draws(self, ids: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """Each id's admission draw in [0, 1): a function of (id, occurrences) alone."""
        drawn = mix64(bits(ids) ^ ADMIT_SALT ^ seen.astype(np.uint64))
        return (drawn >> np.uint64(11)).astype(np.float64) / float(1 << 53)

    def _place(self, ids: np.ndarray, *, protect: np.ndarray) -> tuple[int, np.ndarray]:
        """Gives rows to `ids`, evicting rows other than `protect` (this push's resident ones)
        when there are not enough free; ids beyond what even that frees are left out. How many
        were placed, and their rows (those of the first ones)."""
        short = ids.size - self.n_free
        if short > 0:
            self._evict(max(short, int(self.spec.max_rows * EVICT_CHUNK)), protect=protect)
        placed = ids[: self.n_free]
        if not placed.size:
            return 0, np.zeros(0, np.int64)
        rows = self.free[self.n_free - placed.size : self.n_free][::-1].copy()
        self.n_free -= placed.size
        self.values[rows] = self._initial(placed)
        self.state = jax.tree_util.tree_map(
            lambda leaf, new: _put_rows(leaf, rows, new), self.state, self.fresh
        )
        self.keys[rows] = placed
        self.last[rows] = 0
        self.count[rows] = 0
        self.used[rows] = True
        self.index.add(placed, row=rows)
        return int(rows.size), rows

    def _evict(self, n: int, *, protect: np.ndarray) -> None:
        candidates = self.used.copy()
        candidates[protect] = False
        live = np.flatnonzero(candidates)
        if not live.size:
            return
        keys, last = self.keys[live], self.last[live]
        if self.spec.eviction == "lru":
            victims = live[smallest(n, last, keys)]
        else:
            victims = live[smallest(n, self.count[live], last, keys)]
        self.index.remove(self.keys[victims])
        self.used[victims] = False
        self.free[self.n_free : self.n_free + victims.size] = victims
        self.n_free += victims.size
        self.counters.evicted += int(victims.size)

    # --- checkpoints ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every array of the table at this point, rows in id order: `keys`, `values`,
        `state/<i>` for each optimizer leaf (row-shaped ones cut to the rows), `last`,
        `count`, and the probation (`probation/keys`, `/counts`, `/steps`)."""
        rows = self.index.columns["row"]  # in id order
        out: dict[str, np.ndarray] = {
            "keys": self.keys[rows],
            "values": self.values[rows],
            "last": self.last[rows],
            "count": self.count[rows],
        }
        full = self.values.shape
        for i, leaf in enumerate(jax.tree_util.tree_leaves(self.state)):
            out[f"state/{i}"] = (
                np.asarray(leaf)[rows] if np.shape(leaf) == full else (np.array(leaf))
            )
        out["probation/keys"] = self.waiting.keys.copy()
        out["probation/counts"] = self.waiting.columns["count"].copy()
        out["probation/steps"] = self.waiting.columns["step"].copy()
        return out

    def restore(
        self,
        snapshots: Sequence[Mapping[str, np.ndarray]],
        *,
        ps: int | None = None,
        num_ps: int | None = None,
    ) -> None:
        """Takes the rows and probation this ps owns (under `num_ps` ps, default this part's)
        from the snapshots of any number of ps (`repartition`)."""
        repartition(
            self,
            snapshots,
            ps=self.ps if ps is None else ps,
            num_ps=self.num_ps if num_ps is None else num_ps,
        )


def repartition(
    table: Table, snapshots: Sequence[Mapping[str, np.ndarray]], *, ps: int, num_ps: int
) -> None:
    """Fills the empty `table` with the rows and probation ps `ps` owns under `num_ps` ps, from
    the snapshots of any number of ps (the same table, one job): a table restored onto fewer or
    more ps re-partitions by `owner`. Past `max_rows`, the rows last updated longest ago are
    left out, as eviction would have. Optimizer leaves not shaped like the table (a step
    count) take the largest any snapshot has."""
    if table.resident:
        raise ValueError(f"embedding table {table.spec.name!r}: restored onto a used table")
    leaves, treedef = jax.tree_util.tree_flatten(table.state)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("keys", "values", "last", "count")}
    state_parts: list[list[np.ndarray]] = [[] for _ in leaves]
    waiting: dict[str, list[np.ndarray]] = {k: [] for k in ("keys", "counts", "steps")}
    full = table.values.shape
    for snap in snapshots:
        mine = owner(snap["keys"], num_ps) == ps
        for k, found in parts.items():
            found.append(np.asarray(snap[k])[mine])
        for i, leaf in enumerate(leaves):
            saved = np.asarray(snap[f"state/{i}"])
            state_parts[i].append(saved[mine] if np.shape(leaf) == full else saved[None])
        theirs = owner(np.asarray(snap["probation/keys"]), num_ps) == ps
        for k, found in waiting.items():
            found.append(np.asarray(snap[f"probation/{k}"], np.int64)[theirs])
    keys = np.concatenate(parts["keys"]) if parts["keys"] else np.zeros(0, np.int64)
    order = np.lexsort((keys, -np.concatenate(parts["last"]))) if keys.size else keys
    order = order[: table.spec.max_rows]
    n = int(order.size)
    rows = np.arange(n, dtype=np.int64)
    table.keys[rows] = keys[order]
    table.values[rows] = np.concatenate(parts["values"])[order]
    table.last[rows] = np.concatenate(parts["last"])[order]
    table.count[rows] = np.concatenate(parts["count"])[order]
    restored = []
    for i, leaf in enumerate(leaves):
        joined = np.concatenate(state_parts[i]) if state_parts[i] else None
        if np.shape(leaf) == full:
            rowed = np.array(leaf)
            if joined is not None:
                rowed[rows] = joined[order]
            restored.append(rowed)
        elif joined is not None:  # a step count: the furthest any ps went
            restored.append(joined.max(axis=0).astype(np.asarray(leaf).dtype))
        else:
            restored.append(leaf)
    table.state = jax.tree_util.tree_unflatten(treedef, restored)
    table.used[rows] = True
    table.index.add(table.keys[rows], row=rows)
    table.free = np.arange(table.spec.max_rows - 1, -1, -1, dtype=np.int64)
    table.n_free = table.spec.max_rows - n  # the slots n.. (the stack's first entries)
    if waiting["keys"]:
        table.waiting.add(
            np.concatenate(waiting["keys"]),
            count=np.concatenate(waiting["counts"]),
            step=np.concatenate(waiting["steps"]),
        )
    table.counters.evicted += int(keys.size - n)


def _host(state: Any, shape: tuple[int, ...]) -> Any:
    """Writable host copies of the state's leaves shaped like the table."""
    return jax.tree_util.tree_map(
        lambda leaf: np.array(leaf) if np.shape(leaf) == shape else leaf, state
    )


def _put_rows(leaf: Any, rows: np.ndarray, fresh: Any) -> Any:
    if fresh is None:
        return leaf
    leaf[rows] = fresh
    return leaf


def merged(
    ids: np.ndarray, counts: np.ndarray | None, grads: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One push's rows of a table with each id once: (ids, occurrences, gradient rows), the
    occurrences and gradients of an id given more than once summed (`counts` None: one per
    row given)."""
    ids = np.asarray(ids, dtype=np.int64)
    counts = np.ones(ids.size, np.int64) if counts is None else np.asarray(counts, np.int64)
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):  # a worker's ids: sorted, once each
        return ids, counts, grads
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    return (
        ordered[starts],
        np.add.reduceat(counts[order], starts),
        np.add.reduceat(grads[order], starts, axis=0),
    )
