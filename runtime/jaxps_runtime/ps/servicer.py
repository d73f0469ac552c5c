"""The ParameterServer gRPC servicer: decodes requests, checks them, calls the store.

The small RPCs (Status, Init, Shutdown, SetWorkers, Save, Restore) are here; the streaming
ones (Assign, Read, Update) are `streaming.StreamHandlers`'; who may call is `callers.check`,
what a request means `checks`. Errors become gRPC statuses here, once (`_guarded`).

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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.ps import callers, checks, shardfile
from jaxps_runtime.ps.modes.policy import PsError
from jaxps_runtime.ps.store import ParameterStore
from jaxps_runtime.ps.streaming import StreamHandlers
from jaxps_runtime.wire import rpc, streams

log = logging.getLogger(__name__)


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
        self.bulk_port = 0  # the port of this ps's bulk path (`bulk.BulkServer`), once it has one
        self._streams = StreamHandlers(store)

    # --- control ----------------------------------------------------------------------------

    @_guarded
    def Status(self, request: ps_pb2.StatusRequest, context: grpc.ServicerContext) -> Any:
        callers.check(self.store, request.id, method="Status", ready=False, allow_anonymous=True)
        return self._status()

    def _status(self) -> ps_pb2.StatusReply:
        store = self.store
        return ps_pb2.StatusReply(
            id=store.identity(),
            state=store.state,
            step=store.step,
            tensors=[s.to_proto() for s in store.shards.specs()],
            counters={
                **store.counters.snapshot(),
                **{
                    f"table/{name}/{key}": value
                    for name, part in store.shards.table_counters().items()
                    for key, value in part.items()
                },
            },
            optimizer=store.optimizer_json(),
            mode=store.mode.kind,
            awaiting=store.policy.awaiting(),
            cursors=store.cursors(),
            bulk_port=self.bulk_port,
        )

    @_guarded
    def Init(self, request: ps_pb2.InitRequest, context: grpc.ServicerContext) -> Any:
        callers.check(self.store, request.id, method="Init", ready=False)
        if request.id.cluster_epoch == 0:
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Init.id.cluster_epoch: got 0; expected the new epoch (>= 1)",
            )
        specs = [
            streams.Spec.from_proto(t, where=f"Init.tensors[{i}]")
            for i, t in enumerate(request.tensors)
        ]
        by_rows = checks.declared_rows(request.tensors, specs)
        tables = checks.declared_tables(request.tensors, specs)
        optimizer = checks.init_optimizer(request)
        overrides = checks.init_overrides(request)
        mode = checks.init_mode(request)
        self.store.init(
            epoch=request.id.cluster_epoch,
            specs=specs,
            optimizer=optimizer,
            overrides=overrides,
            step=request.step,
            mode=mode,
            workers=list(request.workers),
            by_rows=by_rows,
            tables=tables,
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
        return self._streams.assign(frames)

    @_guarded
    def Shutdown(self, request: ps_pb2.ShutdownRequest, context: grpc.ServicerContext) -> Any:
        callers.check(self.store, request.id, method="Shutdown", ready=False)
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
        callers.check(self.store, request.id, method="SetWorkers")
        log.info("%s: live workers now %s", self.store.task, list(request.workers))
        self.store.policy.set_workers(list(request.workers))
        return self._status()

    @_guarded
    def Save(self, request: ps_pb2.SaveRequest, context: grpc.ServicerContext) -> Any:
        store = self.store
        callers.check(store, request.id, method="Save")
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
                tables=snapshot.tables,
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
        callers.check(store, request.id, method="Restore", ready=False)
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
            tables=contents.tables,
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
        return self._streams.read(request, context)

    @_guarded
    def Update(
        self, frames: Iterator[bytes] | streams.Direct, context: grpc.ServicerContext
    ) -> Any:
        """A push of gradients: `streaming.StreamHandlers.update`."""
        return self._streams.update(frames, context)
