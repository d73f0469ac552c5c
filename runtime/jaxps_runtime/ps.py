"""The ParameterServer gRPC servicer: decodes requests, checks them, calls the store.

The servicer holds no state of its own beyond the `ParameterStore` (see its thread-safety
contract): grpc may run any number of its methods at once. Every request is checked at the
edge (job id, incarnation, epoch, state, shard names, shapes, chunk bounds) and refused with a
status code and a message naming what was wrong; a refused request changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime import codec, optim, rpc, shardfile, streams
from jaxps_runtime.config import OptimizerConfig
from jaxps_runtime.shards import STATE_NAMES, Held, Mode, ParameterStore, PsError, PushResult

log = logging.getLogger(__name__)


def _abort(context: grpc.ServicerContext, err: PsError | streams.StreamError) -> NoReturn:
    if isinstance(err, PsError):
        if err.reason:
            context.set_trailing_metadata(((rpc.REASON_KEY, err.reason),))
        context.abort(err.code, err.message)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    raise AssertionError("unreachable")  # context.abort raises


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turns PsError and StreamError into gRPC statuses; logs anything unexpected."""
    name = method.__name__

    if name in ("Pull", "SparsePull"):

        def stream(self: ParameterServicer, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except (PsError, streams.StreamError) as err:
                _abort(context, err)

        stream.__name__ = name
        return stream

    def unary(self: ParameterServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except (PsError, streams.StreamError) as err:
            _abort(context, err)

    unary.__name__ = name
    return unary


class ParameterServicer:
    """Serves `jaxps.v1.ParameterServer` for one ps task."""

    def __init__(
        self,
        store: ParameterStore,
        *,
        on_shutdown: Callable[[str], None],
        chunk_bytes: int = streams.CHUNK_BYTES,
    ) -> None:
        self.store = store
        self._on_shutdown = on_shutdown
        self._chunk_bytes = chunk_bytes
        self._shutdown_once = threading.Lock()

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
            awaiting=store.awaiting(),
            cursors=store.cursors(),
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
        )
        log.info(
            "%s: init epoch %d step %d, %d shards, optimizer %s, mode %s, workers %s",
            self.store.task,
            request.id.cluster_epoch,
            request.step,
            len(specs),
            optimizer.to_json(),
            ps_pb2.TrainingMode.Name(request.mode),
            list(request.workers),
        )
        return self._status()

    @_guarded
    def Assign(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        header, first = streams.read_header(request_iterator)
        self.store.check(header.id, method="Assign", ready=False)
        if self.store.state not in (ps_pb2.ASSIGNING, ps_pb2.READY):
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Assign: {self.store.task} is {STATE_NAMES[self.store.state]}; call Init first",
            )
        specs = self._specs(header, where="Assign")
        helds = [self.store.matching(s, where="Assign") for s in specs]
        assembler = streams.Assembler(specs)
        pending = []
        for decoded in self._chunks(first, request_iterator):
            done = assembler.add(decoded)
            if done is not None:
                pending.append(self.store.assign(helds[done].spec.name, assembler.array(done)))
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
        self.store.set_workers(list(request.workers))
        return self._status()

    @_guarded
    def Save(self, request: ps_pb2.SaveRequest, context: grpc.ServicerContext) -> Any:
        store = self.store
        store.check(request.id, method="Save")
        if not request.directory:
            raise PsError(grpc.StatusCode.INVALID_ARGUMENT, "Save.directory: empty")
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

    # --- dense ------------------------------------------------------------------------------

    @_guarded
    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        header, first = streams.read_header(request_iterator)
        return self._push_reply(self._push(header, self._chunks(first, request_iterator)))

    @_guarded
    def PushPull(self, request: bytes, context: grpc.ServicerContext) -> Any:
        store = self.store
        try:
            decoded = codec.decode(request)
        except codec.CodecError as err:
            raise streams.StreamError(f"PushPull: {err}") from err
        if not decoded.frame.HasField("header"):
            raise streams.StreamError("PushPull: the frame has no header")
        header = decoded.frame.header
        store.check(header.id, method="PushPull")
        specs = self._specs(header, where="PushPull")
        views = streams.unpack(decoded.data, specs, where="PushPull")
        # Tensors with rows are embedding rows (as SparsePush), the others dense shards (as Push).
        sparse = [i for i, t in enumerate(header.tensors) if t.rows]
        dense_at = [i for i, t in enumerate(header.tensors) if not t.rows]
        dense = header
        if sparse:
            targets = self._row_targets(header, specs, sparse, where="PushPull")
            for i in dense_at:  # checked before any row is applied: a refusal changes nothing
                store.matching(specs[i], where=f"PushPull.tensors[{i}]")
            dense = tensor_pb2.FrameHeader()
            dense.CopyFrom(header)
            del dense.tensors[:]
            dense.tensors.extend(header.tensors[i] for i in dense_at)
            self._apply_rows(
                [(held, ids, views[i]) for i, (held, ids) in zip(sparse, targets, strict=True)],
                specs=[specs[i] for i in sparse],
                push_id=header.push_id,
            )
        chunks = [
            codec.Decoded(tensor_pb2.Frame(tensor=n), views[i]) for n, i in enumerate(dense_at)
        ]
        result = self._push(dense, iter(chunks), where="PushPull")
        names = [] if header.push_only else [t.name for t in dense.tensors]
        step, arrays, tensors = self._read(
            header.id.task, names, min_step=header.min_step, context=context
        )
        reply = tensor_pb2.FrameHeader(
            id=store.identity(),
            step=step,
            tensors=tensors,
            accepted=result.accepted,
            reason=result.reason,
        )
        return self._packed_reply(reply, arrays)

    @_guarded
    def PullPacked(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Any:
        header, arrays = self._pull(request, context, method="PullPacked")
        return self._packed_reply(header, arrays)

    def _packed_reply(self, header: tensor_pb2.FrameHeader, arrays: list[np.ndarray]) -> bytes:
        packed = streams.pack(header, (streams.byte_view(a) for a in arrays))
        self.store.counters.add("bytes_out", len(packed))
        self.store.counters.add("pulls")
        return packed

    def _push(
        self,
        header: tensor_pb2.FrameHeader,
        chunks: Iterator[codec.Decoded],
        *,
        where: str = "Push",
    ) -> PushResult:
        """A dense push: sync counts it towards the step, async applies it shard by shard."""
        store = self.store
        store.check(header.id, method=where)
        specs = self._specs(header, where=where)
        helds = [store.matching(s, where=where) for s in specs]
        refusal = store.admit(step=header.step)
        if refusal is not None:
            store.note_cursor(header.id.task, header.cursor)
            return refusal
        by_name = {h.spec.name: h for h in helds}
        assembler = streams.Assembler(specs, allocate=lambda spec: by_name[spec.name].staging())
        if store.mode.kind == ps_pb2.SYNC:
            for decoded in chunks:
                assembler.add(decoded)
            store.counters.add("bytes_in", assembler.bytes)
            self._require_complete(assembler, where=where)
            grads = {
                s.name: (h, assembler.array(i))
                for i, (s, h) in enumerate(zip(specs, helds, strict=True))
            }
            contributor = header.id.task or header.push_id
            return store.contribute(
                step=header.step, contributor=contributor, grads=grads, cursor=header.cursor
            )
        # Async and bounded staleness: each shard is updated as soon as its bytes are in.
        try:
            return self._push_async(
                header, chunks, specs=specs, helds=helds, assembler=assembler, where=where
            )
        except BaseException:
            store.release()
            raise

    def _push_async(
        self,
        header: tensor_pb2.FrameHeader,
        chunks: Iterator[codec.Decoded],
        *,
        specs: list[streams.Spec],
        helds: list[Any],
        assembler: streams.Assembler,
        where: str,
    ) -> PushResult:
        store = self.store
        skip = store.already_applied(header.push_id)
        pending = []
        for decoded in chunks:
            done = assembler.add(decoded)
            if done is not None and specs[done].name not in skip:
                grad = assembler.array(done)
                pending.append(store.apply_dense(helds[done], grad, push_id=header.push_id))
        store.counters.add("bytes_in", assembler.bytes)
        missing = assembler.missing()
        for future in pending:
            future.result()
        if missing:
            store.counters.add("pushes_incomplete")
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: stream ended before {', '.join(missing)}; the complete shards were "
                "applied, a retry with the same push_id applies the rest",
            )
        return store.finish_push(
            push_id=header.push_id,
            computed_at=header.step,
            contributor=header.id.task,
            cursor=header.cursor,
        )

    def _push_reply(self, result: PushResult) -> ps_pb2.PushReply:
        return ps_pb2.PushReply(
            id=self.store.identity(),
            accepted=result.accepted,
            step=result.step,
            reason=result.reason,
        )

    @_guarded
    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Any:
        header, arrays = self._pull(request, context, method="Pull")
        yield from self._send(header, arrays, counter="pulls")

    def _pull(
        self, request: ps_pb2.PullRequest, context: grpc.ServicerContext, *, method: str
    ) -> tuple[tensor_pb2.FrameHeader, list[np.ndarray]]:
        """A Pull's reply header and values, once the request passed the checks."""
        store = self.store
        store.check(request.id, method=method)
        step, arrays, tensors = self._read(
            request.id.task,
            list(request.names),
            min_step=request.min_step,
            context=context,
            selections=request.selections,
            where=method,
        )
        return tensor_pb2.FrameHeader(id=store.identity(), step=step, tensors=tensors), arrays

    def _read(
        self,
        task: str,
        names: list[str],
        *,
        min_step: int,
        context: grpc.ServicerContext,
        selections: Sequence[ps_pb2.RowSelection] = (),
        where: str = "Pull",
    ) -> tuple[int, list[np.ndarray], list[tensor_pb2.TensorSpec]]:
        """The values of `names`, then the selected rows, once the step is at least `min_step`
        (and, with bounded staleness, once `task` is no longer too far ahead), all read at one
        step: (step, arrays, their specs; a selection's spec echoes its rows)."""
        store = self.store
        if min_step:
            store.wait_for_step(min_step, is_active=context.is_active)
        store.wait_for_slowest(task, is_active=context.is_active)
        picks = []
        for i, selection in enumerate(selections):
            spec = store.held(selection.name, where=f"{where}.selections[{i}]").spec
            ids = self._row_ids(selection.rows, spec, where=f"{where}.selections[{i}].rows")
            picks.append((selection.name, ids))
        step, values, rows = store.snapshot(names, picks)
        arrays = [np.asarray(v) for _, v in values]
        tensors = [s.to_proto() for s, _ in values]
        for selection, (spec, picked) in zip(selections, rows, strict=True):
            arrays.append(picked)
            shape = (picked.shape[0], *spec.shape[1:])
            tensors.append(streams.Spec(spec.name, shape, spec.dtype).to_proto(rows=selection.rows))
        return step, arrays, tensors

    # --- sparse -----------------------------------------------------------------------------

    @_guarded
    def SparsePull(self, request: ps_pb2.SparsePullRequest, context: grpc.ServicerContext) -> Any:
        store = self.store
        store.check(request.id, method="SparsePull")
        step, arrays, tensors = self._read(
            request.id.task,
            [],
            min_step=request.min_step,
            context=context,
            selections=request.selections,
            where="SparsePull",
        )
        header = tensor_pb2.FrameHeader(id=store.identity(), step=step, tensors=tensors)
        yield from self._send(header, arrays, counter="sparse_pulls")

    @_guarded
    def SparsePush(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        store = self.store
        header, first = streams.read_header(request_iterator)
        store.check(header.id, method="SparsePush")
        specs = self._specs(header, where="SparsePush")
        targets = self._row_targets(header, specs, range(len(specs)), where="SparsePush")
        assembler = streams.Assembler(specs)
        for decoded in self._chunks(first, request_iterator):
            assembler.add(decoded)
        store.counters.add("bytes_in", assembler.bytes)
        self._require_complete(assembler, where="SparsePush")
        self._apply_rows(
            [(held, ids, assembler.array(i)) for i, (held, ids) in enumerate(targets)],
            specs=specs,
            push_id=header.push_id,
        )
        # Rows are applied on arrival in every mode and never count a step: the dense Push of
        # the same worker step does (in sync mode embedding rows are updated Hogwild-style).
        return self._push_reply(PushResult(True, store.step))

    def _row_targets(
        self,
        header: tensor_pb2.FrameHeader,
        specs: Sequence[streams.Spec],
        which: Iterable[int],
        *,
        where: str,
    ) -> list[tuple[Held, np.ndarray]]:
        """The embedding shard and row ids of each sparse tensor `which` of a push, checked."""
        targets = []
        for i in which:
            spec = specs[i]
            held = self.store.matching(spec, where=f"{where}.tensors[{i}]", rows=True)
            ids = self._row_ids(
                header.tensors[i].rows, held.spec, where=f"{where}.tensors[{i}].rows"
            )
            if ids.size != (spec.shape[0] if spec.shape else -1):
                raise PsError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{where}.tensors[{i}]: {ids.size} row ids for {list(spec.shape)} values",
                )
            targets.append((held, ids))
        return targets

    def _apply_rows(
        self,
        rows: Sequence[tuple[Held, np.ndarray, Any]],
        *,
        specs: Sequence[streams.Spec],
        push_id: str,
    ) -> None:
        """Applies gradient rows (held shard, row ids, bytes) of one push and waits for them;
        shards this push_id updated before (a retry) are skipped."""
        if not rows:
            return
        store = self.store
        skip = store.already_applied(push_id)
        pending = []
        for (held, ids, data), spec in zip(rows, specs, strict=True):
            if spec.name in skip:
                continue
            grads = np.frombuffer(data, dtype=spec.dtype).reshape(spec.shape)
            pending.append(store.apply_sparse(held, ids, grads, push_id=push_id))
        for future in pending:
            future.result()
        store.counters.add("sparse_pushes")

    # --- helpers ----------------------------------------------------------------------------

    def _send(
        self, header: tensor_pb2.FrameHeader, arrays: list[np.ndarray], *, counter: str
    ) -> Iterator[bytes]:
        """Streams `arrays` after `header` in ~1 MiB frames, counting what went out."""
        sent = 0
        for raw in streams.frames(
            header, (streams.byte_view(a) for a in arrays), chunk_bytes=self._chunk_bytes
        ):
            sent += len(raw)
            yield raw
        self.store.counters.add("bytes_out", sent)
        self.store.counters.add(counter)

    @staticmethod
    def _specs(header: tensor_pb2.FrameHeader, *, where: str) -> list[streams.Spec]:
        specs = [
            streams.Spec.from_proto(t, where=f"{where}.tensors[{i}]")
            for i, t in enumerate(header.tensors)
        ]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise streams.StreamError(f"{where}.tensors: shard {dup!r} appears twice")
        return specs

    @staticmethod
    def _chunks(first: Any, rest: Iterator[bytes]) -> Iterator[Any]:
        if first.frame.header.tensors or len(first.data):
            yield first
        yield from streams.decode_all(rest)

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
        ids = np.frombuffer(raw, dtype="<i8")
        if ids.size and (ids.min() < 0 or ids.max() >= spec.shape[0]):
            bad = ids[(ids < 0) | (ids >= spec.shape[0])][0]
            raise PsError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"{where}: row {int(bad)} is outside shard {spec.name!r} of {spec.shape[0]} rows",
            )
        return ids
