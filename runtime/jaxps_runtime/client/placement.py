"""Where each variable of a model lives: which ps holds which rows of which leaf.

Pure and deterministic: every process computes the same `Placement` from the same parameter
shapes, whatever order it built them in, so workers, the chief and the ps agree without talking.

1. Leaves are named by their pytree path (`jax.tree_util.keystr`) and sorted by name.
2. A leaf larger than `min_shard_bytes` (TensorFlow's MinSizePartitioner default, 256 KiB) is
   split along axis 0 into `min(num_ps, rows, nbytes // min_shard_bytes)` parts, like
   `np.array_split`; a split leaf never has two parts on the same ps.
3. Shards go to ps tasks greedily by bytes (largest first, each to the least loaded ps, as
   TensorFlow's GreedyLoadBalancingStrategy with byte_size_load_fn) or round-robin by name.
   The strategies' names and the default `min_shard_bytes` are in `catalog` (no numpy there,
   so the configuration is checked without it).

A shard of a leaf split along axis 0 is one contiguous byte range of the leaf in C order, which
lets the client stream it without copying and pull it straight into the leaf's buffer.
The `Placement` is plain data: `to_dict`/`from_dict` for checkpoints and comparisons.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxps_runtime.config import catalog


class PlacementError(ValueError):
    """A placement cannot be computed, or two placements do not match."""


@functools.cache
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


@dataclass(frozen=True, order=True)
class Variable:
    """One leaf of the parameter pytree."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)  # math.prod: ~20x np.prod on tuples

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along axis 0 (the whole leaf for a scalar)."""
        rows = self.shape[0] if self.shape else 1
        return self.nbytes // rows if rows else 0


@dataclass(frozen=True)
class Shard:
    """Rows [start, stop) along axis 0 of `variable`, held by ps task `ps`."""

    name: str
    variable: Variable
    ps: int
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        if not self.variable.shape:
            return ()
        return (self.stop - self.start, *self.variable.shape[1:])

    @property
    def nbytes(self) -> int:
        return (
            self.variable.nbytes
            if not self.variable.shape
            else ((self.stop - self.start) * self.variable.row_bytes)
        )

    @property
    def byte_offset(self) -> int:
        """Where this shard's bytes start inside the variable's C-order buffer."""
        return self.start * self.variable.row_bytes


@dataclass(frozen=True)
class Placement:
    """The shards of every variable and the ps each is on; equal on every process."""

    num_ps: int
    strategy: str
    min_shard_bytes: int
    variables: tuple[Variable, ...]
    shards: tuple[Shard, ...]
    dynamic: tuple[str, ...] = ()  # dynamic tables: one part per ps, rows keyed by id's hash

    def shards_on(self, ps: int) -> tuple[Shard, ...]:
        return tuple(s for s in self.shards if s.ps == ps)

    def shards_of(self, variable: str) -> tuple[Shard, ...]:
        return tuple(s for s in self.shards if s.variable.name == variable)

    def bytes_per_ps(self) -> list[int]:
        load = [0] * self.num_ps
        for shard in self.shards:
            load[shard.ps] += shard.nbytes
        return load

    def to_dict(self) -> dict[str, Any]:
        return {
            "numPs": self.num_ps,
            "strategy": self.strategy,
            "minShardBytes": self.min_shard_bytes,
            "variables": [
                {"name": v.name, "shape": list(v.shape), "dtype": v.dtype} for v in self.variables
            ],
            "shards": [
                {
                    "name": s.name,
                    "variable": s.variable.name,
                    "ps": s.ps,
                    "start": s.start,
                    "stop": s.stop,
                }
                for s in self.shards
            ],
            **({"dynamic": list(self.dynamic)} if self.dynamic else {}),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Placement:
        variables = tuple(
            Variable(v["name"], tuple(int(d) for d in v["shape"]), str(v["dtype"]))
            for v in raw["variables"]
        )
        by_name = {v.name: v for v in variables}
        shards = tuple(
            Shard(s["name"], by_name[s["variable"]], int(s["ps"]), int(s["start"]), int(s["stop"]))
            for s in raw["shards"]
        )
        return cls(
            num_ps=int(raw["numPs"]),
            strategy=str(raw["strategy"]),
            min_shard_bytes=int(raw["minShardBytes"]),
            variables=variables,
            shards=shards,
            dynamic=tuple(str(n) for n in raw.get("dynamic", ())),
        )


def _num_parts(variable: Variable, *, num_ps: int, min_shard_bytes: int) -> int:
    if not variable.shape or variable.nbytes <= min_shard_bytes:
        return 1
    return max(1, min(num_ps, variable.shape[0], variable.nbytes // min_shard_bytes))


def plan(
    variables: Sequence[Variable],
    *,
    num_ps: int,
    strategy: str = catalog.GREEDY,
    min_shard_bytes: int = catalog.DEFAULT_MIN_SHARD_BYTES,
    dynamic: Collection[str] = (),
) -> Placement:
    """Splits and places `variables` (in any order) over `num_ps` ps tasks. `dynamic`: the
    dynamic embedding tables (`ps.dynamic`): each is one part per ps, part k on ps k (its rows
    a multiple of `num_ps`: each ps's capacity), whatever the strategy; which ps holds an id's
    row is the ids' hash's, not the placement's."""
    if num_ps < 1:
        raise PlacementError(f"num_ps: got {num_ps}; expected at least 1 ps task")
    if strategy not in catalog.STRATEGIES:
        raise PlacementError(
            f"strategy: got {strategy!r}; allowed: {', '.join(catalog.STRATEGIES)}"
        )
    if min_shard_bytes < 1:
        raise PlacementError(f"minShardBytes: got {min_shard_bytes}; expected a positive size")
    ordered = sorted(variables)
    names = [v.name for v in ordered]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise PlacementError(f"variables: name {dup!r} appears twice")

    parts: list[tuple[Variable, int, int, int]] = []  # variable, part index, start, stop
    for var in ordered:
        n = _num_parts(var, num_ps=num_ps, min_shard_bytes=min_shard_bytes)
        if var.name in dynamic:
            if len(var.shape) != 2 or var.shape[0] % num_ps:
                raise PlacementError(
                    f"dynamic table {var.name!r}: shape {list(var.shape)} is not [rows, dim] "
                    f"with rows a multiple of {num_ps} ps"
                )
            n = num_ps
        rows = var.shape[0] if var.shape else 0
        base, extra = divmod(rows, n)
        start = 0
        for k in range(n):
            stop = start + base + (1 if k < extra else 0)
            parts.append((var, k, start, stop))
            start = stop

    assignment: dict[tuple[str, int], int] = {}
    for var, k, _, _ in parts:
        if var.name in dynamic:
            assignment[(var.name, k)] = k
    parts_placed = parts
    parts = [p for p in parts if p[0].name not in dynamic]
    if strategy == catalog.ROUND_ROBIN:
        for i, (var, k, _, _) in enumerate(parts):
            assignment[(var.name, k)] = i % num_ps
    else:
        load = [0] * num_ps
        for var, k, start, stop in parts_placed:
            if var.name in dynamic:  # each ps's capacity counts in its load
                load[k] += (stop - start) * var.row_bytes
        taken: dict[str, set[int]] = {}

        def size(part: tuple[Variable, int, int, int]) -> int:
            var, _, start, stop = part
            return var.nbytes if not var.shape else (stop - start) * var.row_bytes

        for part in sorted(parts, key=lambda p: (-size(p), p[0].name, p[1])):
            var = part[0]
            used = taken.setdefault(var.name, set())
            ps = min((i for i in range(num_ps) if i not in used), key=lambda i: (load[i], i))
            used.add(ps)
            load[ps] += size(part)
            assignment[(var.name, part[1])] = ps

    shards = tuple(
        Shard(f"{var.name}/{k}", var, assignment[(var.name, k)], start, stop)
        for var, k, start, stop in parts_placed
    )
    return Placement(
        num_ps=num_ps,
        strategy=strategy,
        min_shard_bytes=min_shard_bytes,
        variables=tuple(ordered),
        shards=shards,
        dynamic=tuple(sorted(dynamic)),
    )


# --- pytrees -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A pytree's structure and its leaves' names, to go from named arrays back to the tree."""

    treedef: Any
    names: tuple[str, ...]  # in treedef leaf order

    def unflatten(self, named: Mapping[str, Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, [named[n] for n in self.names])

    def named(self, tree: Any) -> dict[str, Any]:
        """The leaves of a tree of this structure by name (as `named_leaves`, without making
        the names again: a worker names its gradients on every step)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            return named_leaves(tree)[1]
        return dict(zip(self.names, leaves, strict=True))


def named_leaves(tree: Any) -> tuple[Layout, dict[str, Any]]:
    """The tree's layout and its leaves by path name (`jax.tree_util.keystr`)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = tuple(jax.tree_util.keystr(path) for path, _ in with_path)
    return Layout(treedef, names), {n: leaf for n, (_, leaf) in zip(names, with_path, strict=True)}


def variables_of(tree: Any) -> list[Variable]:
    """The `Variable` of every leaf of a pytree of arrays (or of ShapeDtypeStructs)."""
    _, named = named_leaves(tree)
    return [
        Variable(name, tuple(int(d) for d in np.shape(leaf)), np.dtype(leaf.dtype).name)
        for name, leaf in named.items()
    ]
