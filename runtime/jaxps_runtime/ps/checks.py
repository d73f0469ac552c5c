"""The checks of a request's meaning, made before any of its tensor bytes is read, whichever
path (gRPC or `bulk`) brought it: a step the mode allows, a min_step that can come, each name
once and at most as many as this ps holds (in linear time: a peer chooses the count), the
placement's shapes and dtypes, rows only of tables and within them, an Init's declared tables,
mode and optimizer. Each raises a `PsError` (or `streams.StreamError`) that names the field,
what it got and what is allowed; none changes anything.

Pure functions of the request and what they are given: the declared shards (`shards.Shards`),
the mode and its policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.ps import dynamic, optim
from jaxps_runtime.ps.held import Held
from jaxps_runtime.ps.modes.policy import Policy, PsError
from jaxps_runtime.ps.shards import Shards
from jaxps_runtime.wire import streams
from jaxps_runtime.wire.terms import Mode

# One tensor of gradient rows (or one selection of a Read) carries at most its shard's row
# count of ids, or this many if more: ids may repeat (the ps sums them), so a batch may name
# more ids than a small table has rows.
ROWS_PER_TENSOR = 1 << 16
PUSH_ID_CHARS = 64  # the longest push id a ps takes (and remembers: `pushes.REMEMBERED` of them)


def update_header(
    header: tensor_pb2.FrameHeader,
    specs: Sequence[streams.Spec],
    *,
    shards: Shards,
    mode: Mode,
    policy: Policy,
    staging: dict[str, Held],
) -> dict[int, RowTarget]:
    """The meaning of an Update's header (see `streaming.StreamHandlers.update`): the rows'
    targets by tensor index; fills `staging` with the dense ones' shards. Linear in the number
    of tensors."""
    unique(specs, where="Update", most=shards.size())
    if len(header.push_id) > PUSH_ID_CHARS:
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Update.push_id: {len(header.push_id)} characters; at most {PUSH_ID_CHARS} (a "
            "worker's is a uuid's 32 hex digits)",
        )
    problem = policy.step_problem(header.step)
    if problem is not None:
        raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Update.step: {problem}")
    if header.then_read:
        problem = mode.read_step_problem(header.min_step)
        if problem is not None:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Update.min_step: {problem}")
    rows: dict[int, RowTarget] = {}
    for i, t in enumerate(header.tensors):
        where = f"Update.tensors[{i}]"
        if t.rows:
            rows[i] = row_target(t, specs[i], shards=shards, where=where)
            continue
        held = shards.matching(specs[i], where=where)
        if held.by_rows:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: shard {held.spec.name!r} is an embedding table's, updated by "
                "rows; got a whole gradient without row ids",
            )
        staging[specs[i].name] = held
    return rows


class RowTarget(NamedTuple):
    """Where one tensor of gradient rows goes: the shard, its row ids (a dynamic table's: any
    int64 ids) and, for a dynamic table, each id's occurrences (None: one each)."""

    held: Held
    ids: np.ndarray
    counts: np.ndarray | None = None


def row_target(
    tensor: tensor_pb2.TensorSpec, spec: streams.Spec, *, shards: Shards, where: str
) -> RowTarget:
    """The embedding shard and row ids of one tensor of gradient rows, checked."""
    held = shards.matching(spec, where=where, rows=True)
    if held.by_rows is False:
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: shard {held.spec.name!r} is a dense variable's, updated whole; got "
            f"{len(tensor.rows) // 8} rows of it (rows only update embedding tables)",
        )
    dynamic = held.dynamic is not None
    ids = row_ids(tensor.rows, held.spec, where=f"{where}.rows", keyed=dynamic)
    if ids.size != (spec.shape[0] if spec.shape else -1):
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: {ids.size} row ids for {list(spec.shape)} values",
        )
    counts = None
    if tensor.counts:
        if not dynamic:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}.counts: shard {held.spec.name!r} is a fixed table's; counts are "
                "only for a dynamic table's rows",
            )
        if len(tensor.counts) != 8 * ids.size:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}.counts: {len(tensor.counts)} bytes; expected one little-endian "
                f"int64 per row id ({8 * ids.size} bytes)",
            )
        counts = np.frombuffer(tensor.counts, dtype="<i8")
        if counts.size and (counts.min() < 0 or counts.max() > ROWS_PER_TENSOR):
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}.counts: each is an id's occurrences in one batch, 0..{ROWS_PER_TENSOR}",
            )
    return RowTarget(held, ids, counts)


def read_request(request: ps_pb2.ReadRequest, *, shards: Shards, mode: Mode) -> None:
    """A Read names each shard once, at most as many as this ps holds, and waits for a step
    that can come (`Mode.read_step_problem`)."""
    most = shards.size()
    if len(request.names) > most:
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Read.names: {len(request.names)} names; {shards.task} holds {most} shards",
        )
    if len(request.selections) > most:
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Read.selections: {len(request.selections)} selections; {shards.task} "
            f"holds {most} shards",
        )
    for field, names in (
        ("names", request.names),
        ("selections", (s.name for s in request.selections)),
    ):
        dup = streams.first_duplicate(names)
        if dup is not None:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT, f"Read.{field}: shard {dup!r} appears twice"
            )
    problem = mode.read_step_problem(request.min_step)
    if problem is not None:
        raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Read.min_step: {problem}")


def unique(
    specs: Sequence[streams.Spec], *, where: str, most: int | None = None
) -> Sequence[streams.Spec]:
    """`specs`, once checked that each name comes once (and that there are at most `most`)."""
    if most is not None and len(specs) > most:
        raise streams.StreamError(
            f"{where}.tensors: {len(specs)} tensors; this ps holds {most} shards"
        )
    dup = streams.first_duplicate(s.name for s in specs)
    if dup is not None:
        raise streams.StreamError(f"{where}.tensors: shard {dup!r} appears twice")
    return specs


def require_complete(assembler: streams.Assembler, *, where: str) -> None:
    missing = assembler.missing()
    if missing:
        raise streams.StreamError(f"{where}: stream ended before {', '.join(missing)}")


def row_ids(raw: bytes, spec: streams.Spec, *, where: str, keyed: bool = False) -> np.ndarray:
    """Little-endian int64 row ids of shard `spec`: at most its row count, or `ROWS_PER_TENSOR`
    if more, each one of its rows (`keyed`, a dynamic table's: any int64 ids)."""
    if len(raw) % 8:
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: {len(raw)} bytes; expected little-endian int64 row ids (8 bytes each)",
        )
    if not spec.shape:
        raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: shard {spec.name!r} is a scalar")
    most = max(spec.shape[0], ROWS_PER_TENSOR)
    if len(raw) // 8 > most:
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: {len(raw) // 8} row ids for shard {spec.name!r} of {spec.shape[0]} "
            f"rows; at most {most} (sum the gradients of repeated ids first)",
        )
    ids = np.frombuffer(raw, dtype="<i8")
    if not keyed and ids.size and (ids.min() < 0 or ids.max() >= spec.shape[0]):
        bad = ids[(ids < 0) | (ids >= spec.shape[0])][0]
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: row {int(bad)} is outside shard {spec.name!r}, whose rows are "
            f"0..{spec.shape[0] - 1}",
        )
    return ids


def init_mode(request: ps_pb2.InitRequest) -> Mode:
    """An Init's training mode, its counts none negative."""
    if request.mode == ps_pb2.TRAINING_MODE_UNSPECIFIED:
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "Init.mode: unspecified; expected ASYNC, SYNC or BOUNDED_STALENESS",
        )
    for field in ("replicas_to_aggregate", "max_staleness", "last_step"):
        if getattr(request, field) < 0:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Init.{field}: got {getattr(request, field)}; expected >= 0",
            )
    return Mode(
        kind=request.mode,
        replicas_to_aggregate=request.replicas_to_aggregate,
        max_staleness=request.max_staleness,
        last_step=request.last_step,
    )


def init_optimizer(request: ps_pb2.InitRequest) -> OptimizerConfig:
    """An Init's optimizer, once it builds."""
    try:
        optimizer = OptimizerConfig.from_json(request.optimizer, where="Init.optimizer")
        optim.build(optimizer, where="Init.optimizer")
    except optim.OptimizerError as err:
        raise PsError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
    return optimizer


def init_overrides(request: ps_pb2.InitRequest) -> dict[str, OptimizerConfig]:
    """An Init's per-shard optimizers ({shard name: optimizer}), each once it builds."""
    out: dict[str, OptimizerConfig] = {}
    for i, tensor in enumerate(request.tensors):
        if not tensor.optimizer:
            continue
        where = f"Init.tensors[{i}].optimizer"
        try:
            out[tensor.name] = OptimizerConfig.from_json(tensor.optimizer, where=where)
            optim.build(out[tensor.name], where=where)
        except optim.OptimizerError as err:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
    return out


def declared_tables(
    tensors: Sequence[tensor_pb2.TensorSpec], specs: Sequence[streams.Spec]
) -> dict[str, tuple[dynamic.Spec, int, int]]:
    """The dynamic tables' parts an Init declares: {shard: (spec, ps, num_ps)}, each checked
    against its shard's spec (float32 [maxRows, dim])."""
    out = {}
    for i, (t, spec) in enumerate(zip(tensors, specs, strict=True)):
        if not t.dynamic:
            continue
        where = f"Init.tensors[{i}].dynamic"
        try:
            table, ps, num_ps = dynamic.Spec.from_json(t.dynamic, where=where)
        except ValueError as err:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        if spec.shape != (table.max_rows, table.dim) or spec.dtype != np.float32:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: shard {spec.name!r} is {spec.dtype.name}{list(spec.shape)}; a "
                f"dynamic table of dim {table.dim} and {table.max_rows} rows here is "
                f"float32{[table.max_rows, table.dim]}",
            )
        out[spec.name] = (table, ps, num_ps)
    return out


def declared_rows(
    tensors: Sequence[tensor_pb2.TensorSpec], specs: Sequence[streams.Spec]
) -> set[str] | None:
    """The shards an Init declares updated by rows (see `streams.UPDATED_WHOLE`), or None when
    it declares nothing."""
    declared = [bool(t.rows) for t in tensors]
    if not any(declared):
        return None
    by_rows: set[str] = set()
    for i, (t, spec) in enumerate(zip(tensors, specs, strict=True)):
        where = f"Init.tensors[{i}].rows"
        count = int(np.frombuffer(t.rows, "<i8")[0]) if len(t.rows) == 8 else None
        rows = spec.shape[0] if spec.shape else None
        if count == streams.UPDATED_WHOLE:
            continue
        if count is None or count != rows:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: shard {spec.name!r} {list(spec.shape)}: expected one little-endian "
                f"int64, {streams.UPDATED_WHOLE} (updated whole) or its row count {rows} "
                "(updated by rows); a chief declares every shard or none",
            )
        by_rows.add(spec.name)
    return by_rows
