"""The streaming calls of a ps: Assign and Update, whose tensors arrive in chunks, and Read,
whose reply is tensors, on gRPC and the bulk path alike.

`StreamHandlers` holds no state of its own beyond the store it is given (see the store's
thread-safety contract): grpc may run any number of its calls at once. Every request is checked
for meaning before any of its tensor bytes is read (`checks`); a refused request changes
nothing. What no honest worker sends is INVALID_ARGUMENT (an Update's with reason
`terms.INVALID_REQUEST`, counted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.ps import callers, checks
from jaxps_runtime.ps.held import STATE_NAMES, Held
from jaxps_runtime.ps.modes.policy import Policy, PsError, Push, PushResult
from jaxps_runtime.ps.positions import Claim, InvalidPositionError
from jaxps_runtime.ps.shards import Picked, Shards
from jaxps_runtime.ps.updates import Updater, finite
from jaxps_runtime.wire import streams, terms
from jaxps_runtime.wire.streams import Spec
from jaxps_runtime.wire.terms import INVALID_REQUEST, NONFINITE_GRADIENT, Mode

log = logging.getLogger(__name__)


class Store(callers.Callee, Protocol):
    """What the streaming calls use of a ps's state; `store.ParameterStore` is the one there is."""

    shards: Shards
    updates: Updater

    @property
    def state(self) -> ps_pb2.PsState: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def mode(self) -> Mode: ...

    def identity(self) -> tensor_pb2.Identity: ...

    def assign(self, name: str, array: np.ndarray) -> Future[None]: ...

    def claim(self, *, shard: str, cursor: int, lease: int) -> Claim | str: ...

    def drop(self, claim: Claim | None) -> None: ...

    @property
    def step(self) -> int: ...

    def wait_for_step(self, min_step: int, *, is_active: Callable[[], bool]) -> int: ...

    def snapshot(
        self, names: Iterable[str], rows: Sequence[tuple[str, np.ndarray]] = ()
    ) -> tuple[int, list[tuple[Spec, Any]], list[Picked]]: ...


class StreamHandlers:
    """Assign, Read and Update of one ps task (`servicer.ParameterServicer` delegates them)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def assign(self, frames: Iterator[bytes]) -> ps_pb2.AssignReply:
        """Sets the values of declared shards, each as its bytes are in."""
        store = self.store
        header, assembler, fill = streams.receive(frames, where="Assign")
        callers.check(store, header.id, method="Assign", ready=False)
        if store.state not in (ps_pb2.ASSIGNING, ps_pb2.READY):
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Assign: {store.task} is {STATE_NAMES[store.state]}; call Init first",
            )
        specs = checks.unique(assembler.specs, where="Assign")
        for s in specs:
            store.shards.matching(s, where="Assign")
        pending = [store.assign(specs[i].name, assembler.array(i)) for done in fill for i in done]
        checks.require_complete(assembler, where="Assign")
        for future in pending:
            future.result()
        return ps_pb2.AssignReply(
            id=store.identity(), state=store.state, missing=store.shards.unassigned()
        )

    def read(self, request: ps_pb2.ReadRequest, context: grpc.ServicerContext) -> streams.Reply:
        callers.check(self.store, request.id, method="Read")
        checks.read_request(request, shards=self.store.shards, mode=self.store.mode)
        step, arrays, tensors = self._read(
            request.id.task,
            list(request.names),
            min_step=request.min_step,
            context=context,
            selections=request.selections,
        )
        return self._reply(tensor_pb2.FrameHeader(step=step, tensors=tensors), arrays)

    def update(
        self, frames: Iterator[bytes] | streams.Direct, context: grpc.ServicerContext
    ) -> streams.Reply:
        """Checks the whole header first, then every tensor as its bytes come in (a NaN or an
        inf is refused as INVALID_ARGUMENT), and only once all are in and finite applies them
        (async; sync sums the dense ones into the step; gradient rows are applied at once in
        every mode, Hogwild-style): a refused push changes nothing. An update whose result is
        not finite is refused too, and the shards it concerns keep their values.

        The header is checked for meaning before any tensor byte is read
        (`checks.update_header`): at most as many tensors as this ps holds, each named once;
        each a held shard of its dtype and shape, by rows only where the chief declared a table
        (the ids in range, at most the shard's rows or `checks.ROWS_PER_TENSOR`, whichever is
        more), whole elsewhere; a step the mode allows (`Policy.step_problem`) and a then_read
        min_step that can come. Any of these is INVALID_ARGUMENT with reason `INVALID_REQUEST`
        and changes nothing."""
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
                most=store.shards.size(),
            )
        except streams.HeaderError as err:  # 10,001 names refused before specs are made
            callers.check(store, err.header.id, method="Update")
            raise self._invalid(err, err.header) from None
        callers.check(store, header.id, method="Update")
        policy = store.policy
        try:
            rows = checks.update_header(
                header,
                assembler.specs,
                shards=store.shards,
                mode=store.mode,
                policy=policy,
                staging=staging,
            )
        except (PsError, streams.StreamError) as err:
            if isinstance(err, PsError) and err.code != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            raise self._invalid(err, header) from None
        claim: Claim | None = None
        if header.shard:  # a batch of the job's data: applied once (`positions`)
            try:
                claimed = store.claim(shard=header.shard, cursor=header.cursor, lease=header.lease)
            except InvalidPositionError as err:
                invalid = PsError(grpc.StatusCode.INVALID_ARGUMENT, f"Update.shard: {err}")
                raise self._invalid(invalid, header) from None
            if isinstance(claimed, str):
                store.counters.add(f"pushes_{terms.refusal_word(claimed)}")
                # The batch is in, or in this step's sum from another push (a chief restarted
                # and leased it again): sync counts this worker's share as nothing, so the step
                # does not wait for it.
                if terms.refusal_word(claimed) in (terms.APPLIED, terms.BUSY):
                    policy.count_applied(header.id.task, header.step)
                return self._update_reply(header, PushResult(False, store.step, claimed), context)
            claim = claimed
        refusal = policy.admit(header.step)
        if refusal is not None:
            store.drop(claim)
            return self._update_reply(header, refusal, context)
        try:
            result = self._apply(
                header, fill, assembler, staging=staging, rows=rows, policy=policy, claim=claim
            )
        except BaseException:
            policy.release()
            store.drop(claim)
            raise
        return self._update_reply(header, result, context)

    def _apply(
        self,
        header: tensor_pb2.FrameHeader,
        fill: Iterator[range],
        assembler: streams.Assembler,
        *,
        staging: Mapping[str, Held],
        rows: Mapping[int, checks.RowTarget],
        policy: Policy,
        claim: Claim | None,
    ) -> PushResult:
        store, specs, push_id = self.store, assembler.specs, header.push_id
        updates = store.updates
        sync = not policy.applies_on_arrival
        who = f"pushed by {header.id.task or '?'} at step {header.step}"
        # Nothing is queued before every gradient is in and checked, so that a push with a NaN
        # anywhere changes nothing; the price is that the first shard's update no longer
        # overlaps the last shard's bytes.
        try:
            for done in fill:
                for i in done:
                    self._require_finite(specs[i], assembler.array(i), rows=i in rows, who=who)
        except streams.StreamError as err:  # bytes other than the header's tensors hold
            raise self._invalid(err, header) from None
        store.counters.add("bytes_in", assembler.bytes)
        missing = assembler.missing()
        if missing:
            store.counters.add("pushes_incomplete")
            raise PsError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Update: stream ended before {', '.join(missing)}; nothing of it was applied",
            )
        skip = updates.already_applied(push_id)  # shards a retry of this push updated already
        pending = []
        for i, spec in enumerate(specs):
            if spec.name in skip:
                continue
            grad = assembler.array(i)
            if i in rows:
                held, ids, counts = rows[i]
                if held.dynamic is not None:
                    pending.append(
                        updates.dynamic(held, ids, counts, grad, push_id=push_id, who=who)
                    )
                else:
                    pending.append(updates.sparse(held, ids, grad, push_id=push_id, who=who))
            elif not sync:
                pending.append(updates.dense(staging[spec.name], grad, push_id=push_id, who=who))
        updates.settle(pending)
        if rows:
            store.counters.add("sparse_pushes")
        dense = {
            specs[i].name: (staging[specs[i].name], assembler.array(i))
            for i in range(len(specs))
            if sync and i not in rows
        }
        idle = header.idle and not specs and claim is None
        return policy.count(Push(push_id, header.step, header.id.task, claim, dense, idle=idle))

    def _require_finite(self, spec: Spec, grad: np.ndarray, *, rows: bool, who: str) -> None:
        if finite(grad):
            return
        self.store.counters.refused(NONFINITE_GRADIENT)
        log.warning("%s: refused a non-finite gradient of %r %s", self.store.task, spec.name, who)
        raise PsError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Update: the gradient{' rows' if rows else ''} of {spec.name!r} {who}: not finite "
            "(NaN or inf); nothing of this update was applied",
            reason=NONFINITE_GRADIENT,
        )

    def _invalid(
        self, err: PsError | streams.StreamError, header: tensor_pb2.FrameHeader
    ) -> PsError:
        """The refusal of an Update whose header means nothing: counted (`INVALID_REQUEST`),
        logged, and said to change nothing."""
        self.store.counters.refused(INVALID_REQUEST)
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

    def _update_reply(
        self, request: tensor_pb2.FrameHeader, result: PushResult, context: grpc.ServicerContext
    ) -> streams.Reply:
        """The outcome and, when asked, the values of the updated dense shards."""
        step = result.step
        arrays: list[np.ndarray] = []
        tensors: list[tensor_pb2.TensorSpec] = []
        if request.then_read:
            names = [t.name for t in request.tensors if not t.rows]
            # A batch refused for its position ("revoked", "gap", "busy") did not count: the
            # step it would wait for may need it, so the values are read as they are now.
            word = "" if result.accepted else terms.refusal_word(result.reason)
            waits = word not in terms.POSITION_REFUSALS or word == terms.APPLIED
            step, arrays, tensors = self._read(
                request.id.task,
                names,
                min_step=request.min_step if waits else 0,
                context=context,
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
            held = store.shards.held(selection.name, where=f"Read.selections[{i}]")
            ids = checks.row_ids(
                selection.rows,
                held.spec,
                where=f"Read.selections[{i}].rows",
                keyed=held.dynamic is not None,
            )
            picks.append((selection.name, ids))
        step, values, rows = store.snapshot(names, picks)
        store.counters.add("reads")
        arrays = [np.asarray(v) for _, v in values]
        tensors = [s.to_proto() for s, _ in values]
        for selection, (spec, picked, resident) in zip(selections, rows, strict=True):
            arrays.append(picked)
            shape = (picked.shape[0], *spec.shape[1:])
            echo = selection.rows if resident is None else resident.astype("<i8").tobytes()
            tensors.append(Spec(spec.name, shape, spec.dtype).to_proto(rows=echo))
        return step, arrays, tensors
