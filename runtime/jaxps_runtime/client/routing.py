"""Which ps holds which bytes of a model, for one call: the client's map from whole variables
(`arrays`, by name) to each ps's shards, the byte ranges of those arrays each shard is
(`buffers` to send, `views` to receive into), and the rows of tables each ps holds.

Pure: nothing here talks to a ps. A shard is a contiguous byte range of its variable, so a read
lands in the final arrays and an update sends them without a copy.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.client.placement import Placement, Shard
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.wire import streams
from jaxps_runtime.wire import tables as wire_tables

# Rows of one table on one shard: (shard, shard-local row ids, positions in the caller's ids).
RowPick = tuple[Shard, np.ndarray, np.ndarray]


class Routes:
    """A placement, as the calls of a client use it. Thread-safe (read only)."""

    def __init__(self, placement: Placement, *, num_ps: int) -> None:
        """`num_ps`: how many ps addresses the client has, which must be the placement's."""
        if num_ps != placement.num_ps:
            raise ValueError(
                f"placement is for {placement.num_ps} ps tasks, got {num_ps} addresses"
            )
        self.placement = placement
        self._shards = [placement.shards_on(i) for i in range(placement.num_ps)]
        self._variables = {v.name: v for v in placement.variables}
        # Dynamic tables move by ids alone (`rows`), never whole: left out of `arrays`/`into`.
        self.dynamic = frozenset(placement.dynamic)

    def shards_on(self, ps: int, names: Collection[str] | None = None) -> list[Shard]:
        """The shards `ps` holds, of the variables of `names` only when given."""
        return [s for s in self._shards[ps] if names is None or s.variable.name in names]

    def arrays(
        self, values: Mapping[str, Any], *, what: str, variables: Collection[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Every variable's value (or those of `variables`), C-contiguous in its dtype; `what`
        names them in errors ("gradients", "params")."""
        out = {}
        for var in self.placement.variables:
            if (variables is not None and var.name not in variables) or var.name in self.dynamic:
                continue
            if var.name not in values:
                raise KeyError(f"{what}: no value for variable {var.name!r}")
            array = np.asarray(values[var.name])
            dtype = streams.dtype_of(var.dtype)
            if array.shape != var.shape:
                raise ValueError(
                    f"{what}: {var.name!r} has shape {array.shape}, the placement says {var.shape}"
                )
            out[var.name] = np.ascontiguousarray(array, dtype=dtype)
        return out

    def into(
        self, given: Mapping[str, np.ndarray] | None, variables: Collection[str] | None
    ) -> dict[str, np.ndarray]:
        """The arrays a read lands in, every variable's (or those of `variables`): the `given`
        one where there is one (checked), else a new aligned one."""
        out = {}
        for var in self.placement.variables:
            if (variables is not None and var.name not in variables) or var.name in self.dynamic:
                continue
            dtype = streams.dtype_of(var.dtype)
            array = given.get(var.name) if given else None
            if array is not None and (
                array.shape != var.shape
                or array.dtype != dtype
                or not array.flags.c_contiguous
                or not array.flags.writeable
            ):
                raise ValueError(
                    f"pull into: {var.name!r} must be a writable C-contiguous "
                    f"{dtype.name}{list(var.shape)} array"
                )
            out[var.name] = array if array is not None else streams.empty(var.shape, dtype)
        return out

    def rows(self, rows: Mapping[str, np.ndarray]) -> list[list[RowPick]]:
        """Per ps: (shard, shard-local row ids, positions in the caller's id array)."""
        picks: list[list[RowPick]] = [[] for _ in self._shards]
        for name, given in rows.items():
            variable = self._variables.get(name)
            if variable is None or not variable.shape:
                raise KeyError(f"rows: {name!r} is not a variable with rows")
            ids = np.asarray(given, dtype=np.int64).reshape(-1)
            if name in self.dynamic:  # any int64 id, on the ps its hash names
                parts = {s.ps: s for s in self.placement.shards_of(name)}
                for ps, where in wire_tables.split(ids, self.placement.num_ps):
                    picks[ps].append((parts[ps], ids[where], where))
                continue
            if ids.size and (ids.min() < 0 or ids.max() >= variable.shape[0]):
                raise IndexError(f"rows: {name!r} has rows 0..{variable.shape[0] - 1}")
            for shard in self.placement.shards_of(name):
                where = np.flatnonzero((ids >= shard.start) & (ids < shard.stop))
                if where.size:
                    picks[shard.ps].append((shard, ids[where] - shard.start, where))
        return picks

    def rows_into(self, rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Empty arrays for the asked rows of each table."""
        return {
            name: streams.empty(
                (len(ids), *self._variables[name].shape[1:]),
                streams.dtype_of(self._variables[name].dtype),
            )
            for name, ids in rows.items()
        }


def spec(shard: Shard) -> tensor_pb2.TensorSpec:
    return tensor_pb2.TensorSpec(name=shard.name, shape=shard.shape, dtype=shard.variable.dtype)


def declared_spec(
    shard: Shard,
    tables: Collection[str] | None,
    optimizers: Mapping[str, OptimizerConfig] | None = None,
    dynamic: Mapping[str, wire_tables.Spec] | None = None,
    *,
    num_ps: int = 1,
) -> tensor_pb2.TensorSpec:
    """The spec of a shard in Init, saying how pushes update it when `tables` is known: its
    row count (by rows) or `streams.UPDATED_WHOLE`, as one little-endian int64; its
    variable's optimizer (JSON) when `optimizers` gives it one; and a dynamic table's part
    (`dynamic`: its variable's spec, of one ps's part) as JSON."""
    declared = spec(shard)
    part = (dynamic or {}).get(shard.variable.name)
    if part is not None:
        declared.dynamic = part.to_json(ps=shard.ps, num_ps=num_ps)
    own = (optimizers or {}).get(shard.variable.name)
    declared.optimizer = own.to_json() if own is not None else ""
    if tables is not None:
        table = shard.variable.name in tables and shard.shape
        rows = shard.shape[0] if table else streams.UPDATED_WHOLE
        declared.rows = np.array([rows], "<i8").tobytes()
    return declared


def declared_specs(
    shards: Sequence[Shard],
    tables: Collection[str] | None,
    optimizers: Mapping[str, OptimizerConfig] | None,
    dynamic: Mapping[str, wire_tables.Spec] | None,
    *,
    num_ps: int,
) -> list[tensor_pb2.TensorSpec]:
    """`declared_spec` of each of one ps's shards (of a placement on `num_ps` ps)."""
    return [declared_spec(s, tables, optimizers, dynamic, num_ps=num_ps) for s in shards]


def keyed(picks: Sequence[RowPick], offset: int, dynamic: Collection[str]) -> list[int]:
    """The indices, in a Read reply (its first `offset` tensors whole shards), of the rows of
    dynamic tables: those may come with fewer rows than asked (the resident ones)."""
    return [offset + i for i, (s, _, _) in enumerate(picks) if s.variable.name in dynamic]


def place_rows(
    picks: Sequence[RowPick],
    values: Sequence[np.ndarray],
    header: tensor_pb2.FrameHeader,
    *,
    offset: int,
    picked: Mapping[str, np.ndarray],
    dynamic: Mapping[str, wire_tables.Spec],
) -> None:
    """Puts the rows a Read brought (after its first `offset` tensors) where the caller asked
    them: a fixed table's as they came, a dynamic table's filled in with the initial values
    of the ids not resident (`wire.tables.filled`; ValueError: rows of other ids)."""
    for i, (shard, local, where) in enumerate(picks):
        got = values[offset + i]
        name = shard.variable.name
        if name in dynamic:
            try:
                got = wire_tables.filled(dynamic[name], local, header.tensors[offset + i].rows, got)
            except ValueError as err:
                raise ValueError(f"{name!r}: {err}") from None
        picked[name][where] = got


def expect(shards: Sequence[Shard]) -> list[streams.Spec]:
    """What a ps sends of `shards`, whole."""
    return [streams.Spec(s.name, s.shape, streams.dtype_of(s.variable.dtype)) for s in shards]


def views(arrays: Mapping[str, np.ndarray], shards: Sequence[Shard]) -> list[np.ndarray]:
    """Each shard's part of its variable's array, to receive into in place."""
    out = []
    for shard in shards:
        array = arrays[shard.variable.name]
        flat = array.reshape(-1).view(np.uint8)
        part = flat[shard.byte_offset : shard.byte_offset + shard.nbytes]
        out.append(part.view(array.dtype).reshape(shard.shape))
    return out


def buffers(arrays: Mapping[str, np.ndarray], shards: Sequence[Shard]) -> list[memoryview]:
    """Each shard's bytes of its variable's array, to send without a copy."""
    out = []
    for shard in shards:
        view = streams.byte_view(arrays[shard.variable.name])
        out.append(view[shard.byte_offset : shard.byte_offset + shard.nbytes])
    return out


def selections(picks: Sequence[RowPick]) -> list[ps_pb2.RowSelection]:
    """The rows a read asks of one ps."""
    return [
        ps_pb2.RowSelection(name=s.name, rows=local.astype("<i8").tobytes())
        for s, local, _ in picks
    ]


def expect_rows(picks: Sequence[RowPick]) -> list[streams.Spec]:
    """What a ps sends of the rows of `picks`."""
    return [
        streams.Spec(s.name, (local.size, *s.shape[1:]), streams.dtype_of(s.variable.dtype))
        for s, local, _ in picks
    ]


def row_parts(
    picks: Sequence[RowPick],
    rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
    counts: Mapping[str, np.ndarray] | None = None,
) -> tuple[list[tensor_pb2.TensorSpec], list[memoryview]]:
    """The specs (with their row ids, and a dynamic table's `counts`: each id's occurrences)
    and the bytes of the gradient `rows` one ps gets."""
    values = [
        np.ascontiguousarray(
            np.asarray(rows[s.variable.name][1])[where],
            dtype=streams.dtype_of(s.variable.dtype),
        )
        for s, _, where in picks
    ]
    specs = [
        streams.Spec(s.name, v.shape, v.dtype).to_proto(rows=local.astype("<i8").tobytes())
        for (s, local, _), v in zip(picks, values, strict=True)
    ]
    for declared, (s, _, where) in zip(specs, picks, strict=True):
        given = (counts or {}).get(s.variable.name)
        if given is not None:
            mine = np.asarray(given, "<i8")[where]
            if not (mine == 1).all():  # none: one each, as the ps takes it
                declared.counts = mine.tobytes()
    return specs, [streams.byte_view(v) for v in values]
