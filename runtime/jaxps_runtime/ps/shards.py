"""The shards one ps holds, as its last Init declared them: found by name, a request's spec
checked against them, and their values read.

Thread-safety: `declare` replaces the whole table under the store's lock; a lookup reads the
current table and needs no lock (a reference is read atomically). Reading values takes the
store's lock (row updates write embedding shards in place, see `store`), and so do `specs` and
`unassigned`.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from jaxps_runtime.ps.dynamic import Table
from jaxps_runtime.ps.held import Held
from jaxps_runtime.ps.modes.policy import PsError
from jaxps_runtime.ps.snapshots import readable
from jaxps_runtime.wire.streams import Spec

Picked = tuple[Spec, np.ndarray, np.ndarray | None]
"""Rows read of one shard: its spec, the rows, and (a dynamic table's) the ids they are of."""


class Shards:
    """The declared shards of one ps task, by name."""

    def __init__(self, *, task: str, lock: threading.RLock) -> None:
        self.task = task
        self._lock = lock
        self._held: dict[str, Held] = {}

    def declare(
        self,
        specs: Sequence[Spec],
        *,
        by_rows: Collection[str] | None,
        tables: Mapping[str, Table] | None = None,
    ) -> None:
        """Replaces every shard with unassigned ones of `specs` (with the store's lock held).
        `by_rows`: the shards pushes update by rows; None declares neither kind. `tables`: the
        dynamic tables' parts by shard (their rows keyed by id; valued from the start)."""
        tables = tables or {}
        self._held = {
            s.name: Held(s, by_rows=None if by_rows is None else s.name in by_rows) for s in specs
        }
        for name, table in tables.items():
            held = self._held[name]
            held.by_rows, held.dynamic, held.value = True, table, table.values

    def table(self) -> dict[str, Held]:
        """The shards now, by name (a copy of the table, not of the shards)."""
        return dict(self._held)

    def find(self, name: str) -> Held | None:
        return self._held.get(name)

    def held(self, name: str, *, where: str) -> Held:
        """The shard `name`; INVALID_ARGUMENT (naming `where`) if this ps holds none."""
        held = self._held.get(name)
        if held is None:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {self.task} holds no shard {name!r} ({len(self._held)} shards held)",
            )
        return held

    def size(self) -> int:
        """How many shards this ps holds: the most tensors one request may name."""
        return len(self._held)

    def matching(self, spec: Spec, *, where: str, rows: bool = False) -> Held:
        """The held shard `spec` names, if its dtype and shape fit (row shape for `rows`)."""
        held = self.held(spec.name, where=where)
        want = held.spec.shape[1:] if rows else held.spec.shape
        got = spec.shape[1:] if rows else spec.shape
        if got != want or spec.dtype != held.spec.dtype:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: shard {spec.name!r} is {held.spec.dtype.name}{list(held.spec.shape)}"
                f", got {spec.dtype.name}{list(spec.shape)}",
            )
        return held

    def specs(self) -> list[Spec]:
        with self._lock:
            return [h.spec for h in self._held.values()]

    def unassigned(self) -> list[str]:
        with self._lock:
            return sorted(n for n, h in self._held.items() if h.value is None)

    def all_assigned(self) -> bool:
        return all(h.value is not None for h in self._held.values())

    def read(
        self, names: Iterable[str], rows: Sequence[tuple[str, np.ndarray]] = ()
    ) -> tuple[list[tuple[Spec, Any]], list[Picked]]:
        """The values of the named shards and the rows (name, row ids) of shards, all read
        under the lock: what a reader may keep (`snapshots.readable`). Of a dynamic table's
        part, the rows of the ids resident only, with those ids (the reader computes the
        others' initial values itself, `wire.tables.initial_rows`: a stream of new ids sends
        nothing back); of a fixed table, every row asked (ids None)."""
        with self._lock:
            out = []
            for held in map(self._valued, names):
                if held.dynamic is not None:
                    raise PsError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"Read: {held.spec.name!r} is a dynamic embedding table's part: read "
                        "it by ids (a selection), not whole",
                    )
                out.append((held.spec, readable(held.value)))
            picked = []
            for name, ids in rows:
                held = self._valued(name)
                if held.dynamic is not None:  # the resident ones only: see `dynamic_rows`
                    here, values = held.dynamic.resident_rows(ids)
                    picked.append((held.spec, values, ids[here]))
                else:
                    picked.append((held.spec, np.asarray(held.value)[ids], None))
            return out, picked

    def _valued(self, name: str) -> Held:
        held = self.held(name, where="Read")
        if held.value is None:
            raise PsError(grpc.StatusCode.FAILED_PRECONDITION, f"Read: {name!r} has no value yet")
        return held

    def table_counters(self) -> dict[str, dict[str, float]]:
        """Each dynamic table's part here: resident rows, capacity, and since this part was
        made (an Init or Restore) the ids admitted, evicted, looked up, found (hits) and the
        gradients dropped (ids not admitted), by table name."""
        with self._lock:
            out: dict[str, dict[str, float]] = {}
            for held in self._held.values():
                table = held.dynamic
                if table is None:
                    continue
                c = table.counters
                out[table.spec.name] = {
                    "resident": float(table.resident),
                    "capacity": float(table.spec.max_rows),
                    "admitted": float(c.admitted),
                    "evicted": float(c.evicted),
                    "lookups": float(c.lookups),
                    "hits": float(c.hits),
                    "dropped": float(c.dropped),
                }
            return out
