"""The ParameterServer gRPC servicer: decodes requests, checks them, calls the store.

The servicer holds no state of its own beyond the `ParameterStore` (see its thread-safety
contract): grpc may run any number of its methods at once. Every request is checked at the
edge (job id, incarnation, epoch, state, shard names, shapes, chunk bounds) and refused with a
status code and a message naming what was wrong; a refused request changes nothing.

Data requests are checked for meaning too, before any of their tensor bytes is read, whichever
path (gRPC or `bulk`) brought them: a step the mode allows, a min_step that can come, each
name once and at most as many as this ps holds (in linear time: a peer chooses the count),
the placement's shapes and dtypes, rows only of tables and within them. What no honest worker
sends is INVALID_ARGUMENT (an Update's with reason `terms.INVALID_REQUEST`, counted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.ps import optim, shardfile
from jaxps_runtime.ps.held import Held
from jaxps_runtime.ps.modes.policy import Policy, PsError, Push, PushResult
from jaxps_runtime.ps.store import STATE_NAMES, ParameterStore, finite
from jaxps_runtime.wire import rpc, streams
from jaxps_runtime.wire.terms import INVALID_REQUEST, NONFINITE_GRADIENT, Mode

log = logging.getLogger(__name__)
# One tensor of gradient rows (or one selection of a Read) carries at most its shard's row
# count of ids, or this many if more: ids may repeat (the ps sums them), so a batch may name
# more ids than a small table has rows.
ROWS_PER_TENSOR = 1 << 16


def _abort(context: grpc.ServicerContext, err: PsError | streams.StreamError) -> NoReturn:
    if isinstance(err, PsError):
        if err.reason:
            context.set_trailing_metadata(((rpc.REASON_KEY, err.reason),))
        context.abort(err.code, err.message)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    raise AssertionError("unreachable")  # context.abort raises


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turns PsError and StreamError into gRPC statuses."""

    def guarded(self: ParameterServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except (PsError, streams.StreamError) as err:
            _abort(context, err)

    guarded.__name__ = method.__name__
    return guarded


class ParameterServicer:
    """Serves `jaxps.v1.ParameterServer` for one ps task."""

    def __init__(
        self,
        store: ParameterStore,
        *,
        on_shutdown: Callable[[str], None],
    ) -> None:
        self.store = store
        self._on_shutdown = on_shutdown
        self._shutdown_once = threading.Lock()
        self.bulk_port = 0  # the port of this ps's bulk path (`bulk.BulkServer`), once it has one

    # --- control ----------------------------------------------------------------------------

    @_guarded
    def Status(self, request: ps_pb2.StatusRequest, context: grpc.ServicerContext) -> Any:
        self.store.check(request.id, method="Status", ready=False, allow_anonymous=True)
        return self._status()

    def _status(self) -> ps_pb2.StatusReply:
        store = self.store
        return ps_pb2.StatusReply(
            id=store.identity(),
            state=store.state,
            step=store.step,
            tensors=[s.to_proto() for s in store.specs()],
            counters=store.counters.snapshot(),
            optimizer=store.optimizer_json(),
            mode=store.mode.kind,
            awaiting=store.policy.awaiting(),
            cursors=store.cursors(),
            bulk_port=self.bulk_port,
        )

    @_guarded
    def Init(self, request: ps_pb2.InitRequest, context: grpc.ServicerContext) -> Any:
        self.store.check(request.id, method="Init", ready=False)
        if request.id.cluster_epoch == 0:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Init.id.cluster_epoch: got 0; expected the new epoch (>= 1)",
            )
        specs = [
            streams.Spec.from_proto(t, where=f"Init.tensors[{i}]")
            for i, t in enumerate(request.tensors)
        ]
        by_rows = _declared_rows(request.tensors, specs)
        try:
            optimizer = OptimizerConfig.from_json(request.optimizer, where="Init.optimizer")
            optim.build(optimizer, where="Init.optimizer")
        except optim.OptimizerError as err:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
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
        mode = Mode(
            kind=request.mode,
            replicas_to_aggregate=request.replicas_to_aggregate,
            max_staleness=request.max_staleness,
            last_step=request.last_step,
        )
        self.store.init(
            epoch=request.id.cluster_epoch,
            specs=specs,
            optimizer=optimizer,
            step=request.step,
            mode=mode,
            workers=list(request.workers),
            by_rows=by_rows,
        )
        log.info(
            "%s: init epoch %d step %d, %d shards (%s), optimizer %s, mode %s, workers %s",
            self.store.task,
            request.id.cluster_epoch,
            request.step,
            len(specs),
            "tables undeclared" if by_rows is None else f"{len(by_rows)} updated by rows",
            optimizer.to_json(),
            ps_pb2.TrainingMode.Name(request.mode),
            list(request.workers),
        )
        return self._status()

    @_guarded
    def Assign(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        header, assembler, fill = streams.receive(frames, where="Assign")
        self.store.check(header.id, method="Assign", ready=False)
        if self.store.state not in (ps_pb2.ASSIGNING, ps_pb2.READY):
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Assign: {self.store.task} is {STATE_NAMES[self.store.state]}; call Init first",
            )
        specs = self._unique(assembler.specs, where="Assign")
        for s in specs:
            self.store.matching(s, where="Assign")
        pending = [
            self.store.assign(specs[i].name, assembler.array(i)) for done in fill for i in done
        ]
        self._require_complete(assembler, where="Assign")
        for future in pending:
            future.result()
        return ps_pb2.AssignReply(
            id=self.store.identity(), state=self.store.state, missing=self.store.unassigned()
        )

    @_guarded
    def Shutdown(self, request: ps_pb2.ShutdownRequest, context: grpc.ServicerContext) -> Any:
        self.store.check(request.id, method="Shutdown", ready=False)
        log.info(
            "%s: shutdown requested by %s: %s",
            self.store.task,
            request.id.task or "?",
            request.reason or "no reason given",
        )
        self.store.shutdown()
        reply = ps_pb2.ShutdownReply(id=self.store.identity(), step=self.store.step)
        self._on_shutdown(request.reason or "Shutdown RPC")
        return reply

    @_guarded
    def SetWorkers(self, request: ps_pb2.SetWorkersRequest, context: grpc.ServicerContext) -> Any:
        self.store.check(request.id, method="SetWorkers")
        log.info("%s: live workers now %s", self.store.task, list(request.workers))
        self.store.policy.set_workers(list(request.workers))
        return self._status()

    @_guarded
    def Save(self, request: ps_pb2.SaveRequest, context: grpc.ServicerContext) -> Any:
        store = self.store
        store.check(request.id, method="Save")
        if not request.directory:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, "Save.directory: empty")
        problem = store.mode.read_step_problem(request.step, what="step")
        if problem is not None:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Save.step: {problem}")
        snapshot = store.snapshot_at(request.step, is_active=context.is_active)
        path = Path(request.directory) / f"{store.task}.npz"
        started = time.perf_counter()
        try:
            digest, size = shardfile.write(
                path,
                meta={
                    "step": snapshot.step,
                    "epoch": snapshot.epoch,
                    "task": store.task,
                    "optimizer": snapshot.optimizer,
                },
                values=snapshot.values,
                states=snapshot.states,
            )
        except OSError as err:
            raise PsError(grpc.StatusCode.INTERNAL, f"Save: cannot write {path}: {err}") from err
        log.info(
            "%s: saved step %d to %s (%.1f MB in %.2f s)",
            store.task,
            snapshot.step,
            path,
            size / 1e6,
            time.perf_counter() - started,
        )
        return ps_pb2.CheckpointReply(
            id=store.identity(),
            step=snapshot.step,
            file=str(path),
            sha256=digest,
            bytes=size,
            cursors=snapshot.cursors,
        )

    @_guarded
    def Restore(self, request: ps_pb2.RestoreRequest, context: grpc.ServicerContext) -> Any:
        store = self.store
        store.check(request.id, method="Restore", ready=False)
        if request.id.cluster_epoch != store.identity().cluster_epoch:
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Restore: epoch {request.id.cluster_epoch} is not the epoch of the last Init "
                f"({store.identity().cluster_epoch})",
            )
        path = Path(request.file)
        try:
            contents = shardfile.read(path, expected_sha256=request.sha256)
        except shardfile.ShardFileError as err:
            raise PsError(grpc.StatusCode.DATA_LOSS, f"Restore: {err}") from err
        if contents.meta.get("optimizer") != store.optimizer_json():
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Restore: {path} was saved with optimizer {contents.meta.get('optimizer')}, "
                f"the job now uses {store.optimizer_json()}",
            )
        store.restore(
            step=request.step,
            values=contents.values,
            states=contents.states,
            where=str(path),
            cursors=dict(request.cursors),
        )
        log.info("%s: restored step %d from %s", store.task, request.step, path)
        return ps_pb2.CheckpointReply(
            id=store.identity(),
            step=request.step,
            file=str(path),
            sha256=request.sha256,
            bytes=path.stat().st_size,
        )

    # --- data -----------------------------------------------------------------------------

    @_guarded
    def Read(self, request: ps_pb2.ReadRequest, context: grpc.ServicerContext) -> Any:
        self.store.check(request.id, method="Read")
        self._check_read(request)
        step, arrays, tensors = self._read(
            request.id.task,
            list(request.names),
            min_step=request.min_step,
            context=context,
            selections=request.selections,
        )
        return self._reply(tensor_pb2.FrameHeader(step=step, tensors=tensors), arrays)

    @_guarded
    def Update(
        self, frames: Iterator[bytes] | streams.Direct, context: grpc.ServicerContext
    ) -> Any:
        """Checks the whole header first, then every tensor as its bytes come in (a NaN or an
        inf is refused as INVALID_ARGUMENT), and only once all are in and finite applies them
        (async; sync sums the dense ones into the step; gradient rows are applied at once in
        every mode, Hogwild-style): a refused push changes nothing. An update whose result is
        not finite is refused too, and the shards it concerns keep their values.

        The header is checked for meaning before any tensor byte is read: at most as many
        tensors as this ps holds, each named once; each a held shard of its dtype and shape,
        by rows only where the chief declared a table (the ids in range, at most the shard's
        rows or `ROWS_PER_TENSOR`, whichever is more), whole elsewhere; a step the mode allows
        (`Policy.step_problem`) and a then_read min_step that can come. Any of these is
        INVALID_ARGUMENT with reason `INVALID_REQUEST` and changes nothing."""
        store = self.store
        staging: dict[str, Held] = {}
        try:
            header, assembler, fill = streams.receive(
                frames,
                where="Update",
                allocate=lambda s: (
                    staging[s.name].staging()
                    if s.name in staging
                    else streams.empty(s.shape, s.dtype)
                ),
                most=store.size(),
            )
        except streams.TooManyTensorsError as err:  # refused before 10,001 specs are made
            store.check(err.header.id, method="Update")
            raise self._invalid(err, err.header) from None
        store.check(header.id, method="Update")
        policy = store.policy
        try:
            rows = self._check_update(header, assembler.specs, policy=policy, staging=staging)
        except (PsError, streams.StreamError) as err:
            if isinstance(err, PsError) and err.code != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            raise self._invalid(err, header) from None
        refusal = policy.admit(header.step)
        if refusal is not None:
            store.note_cursor(header.id.task, header.cursor)
            return self._update_reply(header, refusal, context)
        try:
            result = self._apply(header, fill, assembler, staging=staging, rows=rows, policy=policy)
        except BaseException:
            policy.release()
            raise
        return self._update_reply(header, result, context)

    def _apply(
        self,
        header: tensor_pb2.FrameHeader,
        fill: Iterator[range],
        assembler: streams.Assembler,
        *,
        staging: Mapping[str, Held],
        rows: Mapping[int, tuple[Held, np.ndarray]],
        policy: Policy,
    ) -> PushResult:
        store, specs, push_id = self.store, assembler.specs, header.push_id
        sync = not policy.applies_on_arrival
        who = f"pushed by {header.id.task or '?'} at step {header.step}"
        # Nothing is queued before every gradient is in and checked, so that a push with a NaN
        # anywhere changes nothing; the price is that the first shard's update no longer
        # overlaps the last shard's bytes.
        for done in fill:
            for i in done:
                self._require_finite(specs[i], assembler.array(i), rows=i in rows, who=who)
        store.counters.add("bytes_in", assembler.bytes)
        missing = assembler.missing()
        if missing:
            store.counters.add("pushes_incomplete")
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Update: stream ended before {', '.join(missing)}; nothing of it was applied",
            )
        skip = store.already_applied(push_id)  # shards a retry of this push updated already
        pending = []
        for i, spec in enumerate(specs):
            if spec.name in skip:
                continue
            grad = assembler.array(i)
            if i in rows:
                held, ids = rows[i]
                pending.append(store.apply_sparse(held, ids, grad, push_id=push_id, who=who))
            elif not sync:
                pending.append(
                    store.apply_dense(staging[spec.name], grad, push_id=push_id, who=who)
                )
        store.settle(pending)
        if rows:
            store.counters.add("sparse_pushes")
        dense = {
            specs[i].name: (staging[specs[i].name], assembler.array(i))
            for i in range(len(specs))
            if sync and i not in rows
        }
        return policy.count(Push(push_id, header.step, header.id.task, header.cursor, dense))

    def _require_finite(
        self, spec: streams.Spec, grad: np.ndarray, *, rows: bool, who: str
    ) -> None:
        if finite(grad):
            return
        self.store.refused(NONFINITE_GRADIENT)
        log.warning("%s: refused a non-finite gradient of %r %s", self.store.task, spec.name, who)
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Update: the gradient{' rows' if rows else ''} of {spec.name!r} {who}: not finite "
            "(NaN or inf); nothing of this update was applied",
            reason=NONFINITE_GRADIENT,
        )

    def _check_update(
        self,
        header: tensor_pb2.FrameHeader,
        specs: Sequence[streams.Spec],
        *,
        policy: Policy,
        staging: dict[str, Held],
    ) -> dict[int, tuple[Held, np.ndarray]]:
        """The meaning of an Update's header (see `Update`): the rows' targets by tensor index;
        fills `staging` with the dense ones' shards. Linear in the number of tensors."""
        self._unique(specs, where="Update", most=self.store.size())
        problem = policy.step_problem(header.step)
        if problem is not None:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Update.step: {problem}")
        if header.then_read:
            problem = self.store.mode.read_step_problem(header.min_step)
            if problem is not None:
                raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Update.min_step: {problem}")
        rows: dict[int, tuple[Held, np.ndarray]] = {}
        for i, t in enumerate(header.tensors):
            where = f"Update.tensors[{i}]"
            if t.rows:
                rows[i] = self._row_target(t, specs[i], where=where)
                continue
            held = self.store.matching(specs[i], where=where)
            if held.by_rows:
                raise PsError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}: shard {held.spec.name!r} is an embedding table's, updated by "
                    "rows; got a whole gradient without row ids",
                )
            staging[specs[i].name] = held
        return rows

    def _invalid(
        self, err: PsError | streams.StreamError, header: tensor_pb2.FrameHeader
    ) -> PsError:
        """The refusal of an Update whose header means nothing: counted (`INVALID_REQUEST`),
        logged, and said to change nothing."""
        self.store.refused(INVALID_REQUEST)
        message = err.message if isinstance(err, PsError) else str(err)
        log.warning(
            "%s: refused an update pushed by %s at step %d: %s",
            self.store.task,
            header.id.task or "?",
            header.step,
            message[:500],
        )
        return PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{message}; nothing of this update was applied",
            reason=INVALID_REQUEST,
        )

    def _check_read(self, request: ps_pb2.ReadRequest) -> None:
        """A Read names each shard once, at most as many as this ps holds, and waits for a step
        that can come (`Mode.read_step_problem`)."""
        most = self.store.size()
        if len(request.names) > most:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Read.names: {len(request.names)} names; {self.store.task} holds {most} shards",
            )
        if len(request.selections) > most:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Read.selections: {len(request.selections)} selections; {self.store.task} "
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
        problem = self.store.mode.read_step_problem(request.min_step)
        if problem is not None:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Read.min_step: {problem}")

    def _update_reply(
        self, request: tensor_pb2.FrameHeader, result: PushResult, context: grpc.ServicerContext
    ) -> streams.Reply:
        """The outcome and, when asked, the values of the updated dense shards."""
        step = result.step
        arrays: list[np.ndarray] = []
        tensors: list[tensor_pb2.TensorSpec] = []
        if request.then_read:
            names = [t.name for t in request.tensors if not t.rows]
            step, arrays, tensors = self._read(
                request.id.task, names, min_step=request.min_step, context=context
            )
        header = tensor_pb2.FrameHeader(
            step=step, tensors=tensors, accepted=result.accepted, reason=result.reason
        )
        return self._reply(header, arrays)

    def _reply(self, header: tensor_pb2.FrameHeader, arrays: list[np.ndarray]) -> streams.Reply:
        header.id.CopyFrom(self.store.identity())
        reply = streams.Reply(header, [streams.byte_view(a) for a in arrays])
        self.store.counters.add("bytes_out", reply.nbytes)
        return reply

    def _read(
        self,
        task: str,
        names: list[str],
        *,
        min_step: int,
        context: grpc.ServicerContext,
        selections: Sequence[ps_pb2.RowSelection] = (),
    ) -> tuple[int, list[np.ndarray], list[tensor_pb2.TensorSpec]]:
        """The values of `names`, then the selected rows, once the step is at least `min_step`
        (and, with bounded staleness, once `task` is no longer too far ahead), all read at one
        step: (step, arrays, their specs; a selection's spec echoes its rows)."""
        store = self.store
        if min_step:
            store.wait_for_step(min_step, is_active=context.is_active)
        store.policy.before_read(task, is_active=context.is_active)
        picks = []
        for i, selection in enumerate(selections):
            spec = store.held(selection.name, where=f"Read.selections[{i}]").spec
            ids = self._row_ids(selection.rows, spec, where=f"Read.selections[{i}].rows")
            picks.append((selection.name, ids))
        step, values, rows = store.snapshot(names, picks)
        store.counters.add("reads")
        arrays = [np.asarray(v) for _, v in values]
        tensors = [s.to_proto() for s, _ in values]
        for selection, (spec, picked) in zip(selections, rows, strict=True):
            arrays.append(picked)
            shape = (picked.shape[0], *spec.shape[1:])
            tensors.append(streams.Spec(spec.name, shape, spec.dtype).to_proto(rows=selection.rows))
        return step, arrays, tensors

    def _row_target(
        self, tensor: tensor_pb2.TensorSpec, spec: streams.Spec, *, where: str
    ) -> tuple[Held, np.ndarray]:
        """The embedding shard and row ids of one tensor of gradient rows, checked."""
        held = self.store.matching(spec, where=where, rows=True)
        if held.by_rows is False:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: shard {held.spec.name!r} is a dense variable's, updated whole; got "
                f"{len(tensor.rows) // 8} rows of it (rows only update embedding tables)",
            )
        ids = self._row_ids(tensor.rows, held.spec, where=f"{where}.rows")
        if ids.size != (spec.shape[0] if spec.shape else -1):
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {ids.size} row ids for {list(spec.shape)} values",
            )
        return held, ids

    # --- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _unique(
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

    @staticmethod
    def _require_complete(assembler: streams.Assembler, *, where: str) -> None:
        missing = assembler.missing()
        if missing:
            raise streams.StreamError(f"{where}: stream ended before {', '.join(missing)}")

    @staticmethod
    def _row_ids(raw: bytes, spec: streams.Spec, *, where: str) -> np.ndarray:
        if len(raw) % 8:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {len(raw)} bytes; expected little-endian int64 row ids (8 bytes each)",
            )
        if not spec.shape:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{where}: shard {spec.name!r} is a scalar"
            )
        most = max(spec.shape[0], ROWS_PER_TENSOR)
        if len(raw) // 8 > most:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: {len(raw) // 8} row ids for shard {spec.name!r} of {spec.shape[0]} "
                f"rows; at most {most} (sum the gradients of repeated ids first)",
            )
        ids = np.frombuffer(raw, dtype="<i8")
        if ids.size and (ids.min() < 0 or ids.max() >= spec.shape[0]):
            bad = ids[(ids < 0) | (ids >= spec.shape[0])][0]
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: row {int(bad)} is outside shard {spec.name!r}, whose rows are "
                f"0..{spec.shape[0] - 1}",
            )
        return ids


def _declared_rows(
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
