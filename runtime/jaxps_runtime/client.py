"""The client side of the ps tier: pull and push whole pytrees across every ps, in parallel.

One channel per ps, reused for the life of the client; the calling thread talks to ps 0 and one
long-lived pool thread to each other ps, so all ps tasks transfer at once. A pull writes each
chunk straight into the final array of its variable (a shard is a contiguous byte range of its
variable); a push streams byte ranges of the gradient arrays without copying them first.

Thread-safety: one call at a time per client (pull, push and the rest share per-ps streams'
executor and the incarnations the client has seen). Use one client per thread of work.

Stopping (`stopping`): once the task is told to stop, the client ends its calls in flight by
closing its channels, except that a push in flight first gets `stopping.PUSH_GRACE_SECONDS` to
finish (on every ps, not only some); no push and no Shutdown starts afterwards, retries and waits
end, and every call raises `stopping.Stopped` instead of `PsClientError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime import codec, rpc, stopping, streams
from jaxps_runtime.checkpoint import merged_cursors
from jaxps_runtime.config import OptimizerConfig
from jaxps_runtime.credentials import TaskCredentials
from jaxps_runtime.placement import Layout, Placement, Shard, named_leaves
from jaxps_runtime.shards import Mode

log = logging.getLogger(__name__)
T = TypeVar("T")
# Where one tensor of a packed reply goes: its expected spec and what takes its values.
Sink = tuple[streams.Spec, Callable[[np.ndarray], None]]
# Rows of one table on one shard: (shard, shard-local row ids, positions in the caller's ids).
RowPick = tuple[Shard, np.ndarray, np.ndarray]
# Transient failures are retried after these pauses; a ps that restarted answers
# FAILED_PRECONDITION on the next try, which goes to the caller at once.
RETRY_BACKOFF = (0.1, 0.3, 0.9)
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def _put_rows(target: np.ndarray, where: np.ndarray, values: np.ndarray) -> None:
    target[where] = values


class PsClientError(RuntimeError):
    """A ps refused or failed a call; says which ps, where, and what it answered."""

    def __init__(
        self, *, ps: int, address: str, method: str, code: grpc.StatusCode | None, details: str
    ) -> None:
        name = code.name if code else "ERROR"
        super().__init__(f"ps-{ps} at {address}: {method} failed with {name}: {details}")
        self.ps, self.address, self.method, self.code, self.details = (
            ps,
            address,
            method,
            code,
            details,
        )


class PsRestartedError(PsClientError):
    """A ps answered with another incarnation than before: it restarted and lost its state."""


class PsClient:
    """Pulls parameters from and pushes gradients to every ps of a job."""

    def __init__(
        self,
        *,
        addresses: Sequence[str],
        placement: Placement,
        job_id: str,
        task: str,
        chunk_bytes: int = streams.CHUNK_BYTES,
        stop: stopping.Stop | None = None,
        credentials: TaskCredentials | None = None,
    ) -> None:
        if len(addresses) != placement.num_ps:
            raise ValueError(
                f"placement is for {placement.num_ps} ps tasks, got {len(addresses)} addresses"
            )
        self.addresses = tuple(addresses)
        self.placement = placement
        self.job_id, self.task = job_id, task
        self.epoch = 0
        self.incarnations = [0] * len(addresses)
        self.cursors: dict[str, int] = {}  # workers' data cursors, as of the last wait_ready
        self._chunk_bytes = chunk_bytes
        self._channels = [rpc.channel(a, credentials) for a in addresses]
        self._calls = [rpc.PARAMETER_SERVER.callables(ch) for ch in self._channels]
        self._pool = ThreadPoolExecutor(len(addresses), thread_name_prefix=f"{task}-ps")
        self._shards = [placement.shards_on(i) for i in range(len(addresses))]
        self._variables = {v.name: v for v in placement.variables}
        self._stop = stop or stopping.Stop()
        self._pushes = threading.Condition()
        self._pushing = 0  # pushes in flight
        self._cancelled = False  # the channels are closed (or about to be): the task is stopping
        self._unregister = self._stop.callback(self._cancel)

    # --- plumbing ---------------------------------------------------------------------------

    def identity(self, ps: int) -> tensor_pb2.Identity:
        return tensor_pb2.Identity(
            job_id=self.job_id,
            ps_incarnation=self.incarnations[ps],
            cluster_epoch=self.epoch,
            task=self.task,
        )

    def _call(self, ps: int, method: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as err:
            self._stop.check()  # cancelled because the task is stopping
            code, details = err.code(), err.details() or ""
            trailing = dict(err.trailing_metadata() or ())
            restarted = trailing.get(rpc.REASON_KEY) == rpc.PS_RESTARTED
            cls = PsRestartedError if restarted else PsClientError
            raise cls(
                ps=ps, address=self.addresses[ps], method=method, code=code, details=details
            ) from err
        except ValueError:  # grpc's "Cannot invoke RPC on closed channel!"
            if self._cancelled:
                raise stopping.Stopped(f"{method} to ps-{ps}: {self._stop.reason}") from None
            raise

    @contextlib.contextmanager
    def _push(self) -> Iterator[None]:
        """Marks a push in flight: `_cancel` lets it finish before closing the channels."""
        with self._pushes:
            self._stop.check()  # no push starts once the task is stopping
            self._pushing += 1
        try:
            yield
        finally:
            with self._pushes:
                self._pushing -= 1
                self._pushes.notify_all()

    def _cancel(self) -> None:
        """Ends every call in flight (the task is stopping), a push in flight after it finished
        or `stopping.PUSH_GRACE_SECONDS` passed; calls then raise `stopping.Stopped`."""
        with self._pushes:
            self._cancelled = True
            self._pushes.wait_for(lambda: self._pushing == 0, timeout=stopping.PUSH_GRACE_SECONDS)
        for channel in self._channels:
            channel.close()

    def _retrying(self, ps: int, fn: Callable[[], T]) -> T:
        """Runs fn, again after a backoff when the failure looks transient (the peer did not
        answer). Callers make fn idempotent: a push is retried with the same push_id."""
        for attempt in range(len(RETRY_BACKOFF) + 1):
            try:
                return fn()
            except PsClientError as err:
                if err.code not in TRANSIENT or attempt == len(RETRY_BACKOFF):
                    raise
                log.debug("%s: %s; retrying in %.1f s", self.task, err, RETRY_BACKOFF[attempt])
                self._stop.sleep(RETRY_BACKOFF[attempt])
        raise AssertionError("unreachable")

    def _seen(self, ps: int, identity: tensor_pb2.Identity) -> None:
        known = self.incarnations[ps]
        if known and identity.ps_incarnation != known:
            raise PsRestartedError(
                ps=ps,
                address=self.addresses[ps],
                method="reply",
                code=None,
                details=f"incarnation changed from {known} to {identity.ps_incarnation}",
            )
        self.incarnations[ps] = identity.ps_incarnation

    def _each(self, fn: Callable[[int], T]) -> list[T]:
        """Runs fn(ps) for every ps at once and waits for all of them; then raises the first
        error (by ps index), if any. No call is still in flight when this returns or raises:
        a caller that goes on after an error must not race a call it started.

        ps 0 runs in the calling thread, the others on the pool's threads, which live as long
        as the client (a grpc future would start a thread per channel and burst of calls)."""
        running = [self._pool.submit(fn, i) for i in range(1, len(self.addresses))]
        try:
            first = fn(0)
        finally:
            futures_wait(running)
        return [first, *(f.result() for f in running)]

    # --- control ----------------------------------------------------------------------------

    def status(
        self, ps: int, *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> ps_pb2.StatusReply:
        request = ps_pb2.StatusRequest(id=tensor_pb2.Identity(job_id=self.job_id, task=self.task))
        reply: ps_pb2.StatusReply = self._call(
            ps,
            "Status",
            lambda: self._calls[ps]["Status"](
                request, timeout=timeout, wait_for_ready=wait_for_ready
            ),
        )
        return reply

    def wait_reachable(self, *, timeout: float, log_every: float = 5.0) -> list[ps_pb2.StatusReply]:
        """Waits until every ps answers Status, logging which ps and address it waits for."""
        started = time.monotonic()
        replies: list[ps_pb2.StatusReply | None] = [None] * len(self.addresses)
        last_log = started
        while True:
            self._stop.check()
            for ps, reply in enumerate(replies):
                if reply is None:
                    try:
                        replies[ps] = self.status(ps, timeout=1.0, wait_for_ready=True)
                    except PsClientError as err:
                        if err.code not in (
                            grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                        ):
                            raise
            waiting = [ps for ps, r in enumerate(replies) if r is None]
            if not waiting:
                return [r for r in replies if r is not None]
            elapsed = time.monotonic() - started
            names = ", ".join(f"ps-{i} at {self.addresses[i]}" for i in waiting)
            if elapsed >= timeout:
                raise TimeoutError(f"{self.task}: no answer from {names} after {elapsed:.0f} s")
            if time.monotonic() - last_log >= log_every:
                log.info("%s: waiting for %s (%.0f s)", self.task, names, elapsed)
                last_log = time.monotonic()

    def wait_ready(self, *, timeout: float, log_every: float = 5.0) -> int:
        """Waits until every ps is READY at one epoch (the chief initialised them); the step.

        Adopts the epoch and the incarnations the ps tasks report, and the workers' data
        cursors (`cursors`), logging which ps it is still waiting for and in which state.
        """
        self.wait_reachable(timeout=timeout, log_every=log_every)
        started = last_log = time.monotonic()
        while True:
            replies = self._each(lambda ps: self.status(ps, timeout=10))
            epochs = {r.id.cluster_epoch for r in replies}
            waiting = [i for i, r in enumerate(replies) if r.state != ps_pb2.READY]
            if not waiting and len(epochs) == 1:
                self.epoch = epochs.pop()
                self.incarnations = [r.id.ps_incarnation for r in replies]
                self.cursors = merged_cursors(replies, how=max)
                return min(r.step for r in replies)
            elapsed = time.monotonic() - started
            names = (
                ", ".join(f"ps-{i} ({ps_pb2.PsState.Name(replies[i].state)})" for i in waiting)
                or f"one epoch (ps are at {sorted(epochs)})"
            )
            if elapsed >= timeout:
                raise TimeoutError(f"{self.task}: still waiting for {names} after {elapsed:.0f} s")
            if time.monotonic() - last_log >= log_every:
                log.info("%s: waiting for the chief to initialise %s", self.task, names)
                last_log = time.monotonic()
            self._stop.sleep(0.2)

    def statuses(self, *, timeout: float = 10) -> list[ps_pb2.StatusReply]:
        """Every ps's Status, at once."""
        return self._each(lambda ps: self.status(ps, timeout=timeout))

    def init(
        self,
        params: Mapping[str, np.ndarray] | None,
        *,
        optimizer: OptimizerConfig,
        epoch: int,
        step: int = 0,
        mode: Mode | None = None,
        workers: Sequence[str] = (),
    ) -> None:
        """Declares every ps's shards and mode, then streams their initial values (chief only).

        With `params` None the shards are only declared: `restore` fills them from a checkpoint.
        """
        self.epoch = epoch
        mode = mode or Mode()
        arrays = self._named_arrays(params, what="params") if params is not None else None

        def one(ps: int) -> None:
            shards = self._shards[ps]
            request = ps_pb2.InitRequest(
                id=self.identity(ps),
                tensors=[self._spec(s) for s in shards],
                optimizer=optimizer.to_json(),
                step=step,
                mode=mode.kind,
                replicas_to_aggregate=mode.replicas_to_aggregate,
                max_staleness=mode.max_staleness,
                last_step=mode.last_step,
                workers=list(workers),
            )
            reply = self._call(ps, "Init", lambda: self._calls[ps]["Init"](request))
            self._seen(ps, reply.id)
            if arrays is None:
                return
            header = tensor_pb2.FrameHeader(
                id=self.identity(ps), step=step, tensors=[self._spec(s) for s in shards]
            )
            frames = streams.frames(
                header, self._buffers(arrays, shards), chunk_bytes=self._chunk_bytes
            )
            assigned = self._call(ps, "Assign", lambda: self._calls[ps]["Assign"](frames))
            if assigned.missing:
                raise PsClientError(
                    ps=ps,
                    address=self.addresses[ps],
                    method="Assign",
                    code=None,
                    details=f"still missing {list(assigned.missing)}",
                )

        self._each(one)

    def save(self, *, step: int, directory: str, timeout: float) -> list[ps_pb2.CheckpointReply]:
        """Every ps writes its part of the checkpoint of `step` (waiting to get there)."""

        def one(ps: int) -> ps_pb2.CheckpointReply:
            request = ps_pb2.SaveRequest(id=self.identity(ps), step=step, directory=directory)
            reply: ps_pb2.CheckpointReply = self._call(
                ps, "Save", lambda: self._calls[ps]["Save"](request, timeout=timeout)
            )
            return reply

        return self._each(one)

    def restore(
        self,
        files: Sequence[tuple[str, str]],
        *,
        step: int,
        cursors: Mapping[str, int] | None = None,
    ) -> None:
        """Every ps loads its (file, sha256) of a checkpoint (after `init` declared the
        shards), and the workers' data cursors the checkpoint holds."""

        def one(ps: int) -> None:
            file, digest = files[ps]
            request = ps_pb2.RestoreRequest(
                id=self.identity(ps), step=step, file=file, sha256=digest, cursors=cursors
            )
            self._call(ps, "Restore", lambda: self._calls[ps]["Restore"](request, timeout=300))

        self._each(one)

    def set_workers(self, workers: Sequence[str]) -> None:
        """Tells every ps which workers are alive (chief only)."""

        def one(ps: int) -> None:
            request = ps_pb2.SetWorkersRequest(id=self.identity(ps), workers=list(workers))
            self._call(ps, "SetWorkers", lambda: self._calls[ps]["SetWorkers"](request, timeout=30))

        self._each(one)

    def shutdown(self, *, reason: str) -> None:
        """Asks every ps to exit 0; a ps that is already gone counts as done. A ps that
        restarted meanwhile is told too (the request names no incarnation): the job is over.
        Never once the task is stopping (`stopping.Stopped`)."""
        self._stop.check()  # a stopping chief leaves the ps tasks to its replacement

        def one(ps: int) -> None:
            caller = tensor_pb2.Identity(job_id=self.job_id, task=self.task)
            request = ps_pb2.ShutdownRequest(id=caller, reason=reason)
            try:
                self._call(ps, "Shutdown", lambda: self._calls[ps]["Shutdown"](request, timeout=10))
            except PsClientError as err:
                if err.code != grpc.StatusCode.UNAVAILABLE:
                    raise

        self._each(one)

    # --- dense ------------------------------------------------------------------------------

    def pull(
        self,
        *,
        min_step: int = 0,
        into: Mapping[str, np.ndarray] | None = None,
        variables: Collection[str] | None = None,
    ) -> tuple[int, dict[str, np.ndarray]]:
        """Every variable, whole; and the lowest step among the ps tasks.

        `into` (for instance the arrays of the previous pull, once they are no longer used)
        receives the values in place: a training loop that reuses its buffers saves the page
        faults of 2 x model size of fresh memory per step. `variables` limits the pull to those
        (a model pulls its dense variables whole and only the rows it needs of its tables).
        """
        out = self._outputs(into, variables)

        def one(ps: int) -> int:
            shards = [s for s in self._shards[ps] if s.variable.name in out]
            request = ps_pb2.PullRequest(
                id=self.identity(ps), names=[s.name for s in shards], min_step=min_step
            )
            into = [self._shard_view(out[s.variable.name], s) for s in shards]
            return self._retrying(
                ps,
                lambda: self._receive(
                    ps,
                    "Pull",
                    start=lambda: self._calls[ps]["Pull"](request),
                    specs=[self._stream_spec(s) for s in shards],
                    into=into,
                ),
            )

        steps = self._each(one)
        return min(steps), out

    def push(
        self,
        grads: Mapping[str, Any],
        *,
        step: int,
        push_id: str | None = None,
        variables: Collection[str] | None = None,
        cursor: int = 0,
    ) -> list[ps_pb2.PushReply]:
        """Pushes one gradient for every variable (or for `variables`) to every ps at once,
        with the worker's data `cursor` once it counts (`FrameHeader.cursor`).

        Every ps gets the push, even one holding none of its shards, so that each counts it.
        """
        arrays = self._named_arrays(grads, what="gradients", variables=variables)
        push_id = push_id or uuid.uuid4().hex

        def one(ps: int) -> ps_pb2.PushReply:
            shards = [s for s in self._shards[ps] if s.variable.name in arrays]
            header = tensor_pb2.FrameHeader(
                id=self.identity(ps),
                step=step,
                push_id=push_id,
                tensors=[self._spec(s) for s in shards],
                cursor=cursor,
            )

            def attempt() -> ps_pb2.PushReply:
                frames = streams.frames(
                    header, self._buffers(arrays, shards), chunk_bytes=self._chunk_bytes
                )
                reply: ps_pb2.PushReply = self._call(
                    ps, "Push", lambda: self._calls[ps]["Push"](frames)
                )
                return reply

            reply = self._retrying(ps, attempt)
            self._seen(ps, reply.id)
            return reply

        with self._push():
            return self._each(one)

    def packs(self, variables: Collection[str]) -> bool:
        """Whether `variables` fit one frame per ps, so `push_pull` can carry a whole step."""
        return all(
            sum(s.nbytes for s in shards if s.variable.name in variables) <= self._chunk_bytes
            for shards in self._shards
        )

    def push_pull(
        self,
        grads: Mapping[str, Any],
        *,
        step: int,
        min_step: int,
        into: Mapping[str, np.ndarray] | None = None,
        variables: Collection[str] | None = None,
        push_id: str | None = None,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
        push_only: bool = False,
        cursor: int = 0,
    ) -> tuple[int, dict[str, np.ndarray], list[ps_pb2.PushReply]]:
        """`push` (and `sparse_push` of `rows`) then `pull(min_step=...)` of the same dense
        variables, in one round trip per ps; with `push_only`, the push alone (no values).

        Only for variables that fit one frame per ps (`packs`). The calls to every ps are in
        flight at once without a thread each; a transient failure is retried with the same
        push_id, so a push is applied once. Returns (the lowest step among the ps tasks, the
        values, one PushReply per ps).
        """
        arrays = self._named_arrays(grads, what="gradients", variables=variables)
        out = {} if push_only else self._outputs(into, variables)
        plan = self._route_rows({name: ids for name, (ids, _) in (rows or {}).items()})
        push_id = push_id or uuid.uuid4().hex
        calls = []
        for ps, held in enumerate(self._shards):
            shards = [s for s in held if s.variable.name in arrays]
            specs, values = self._row_parts(plan[ps], rows or {})
            header = tensor_pb2.FrameHeader(
                id=self.identity(ps),
                step=step,
                push_id=push_id,
                min_step=min_step,
                push_only=push_only,
                tensors=[*(self._spec(s) for s in shards), *specs],
                cursor=cursor,
            )
            buffers = [*self._buffers(arrays, shards), *map(streams.byte_view, values)]
            sinks = [] if push_only else self._dense_sinks(shards, out)
            calls.append((sinks, streams.pack(header, buffers)))
        with self._push():
            replies = self._packed_calls("PushPull", calls)
        return min(r.step for r in replies), out, replies

    def pull_packed(
        self,
        *,
        min_step: int = 0,
        into: Mapping[str, np.ndarray] | None = None,
        variables: Collection[str] | None = None,
        rows: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[int, dict[str, np.ndarray]]:
        """`pull` (and `sparse_pull` of `rows`, read at the same step) in one message per ps,
        for dense variables that fit one frame per ps (`packs`). The values hold each table of
        `rows` as the rows asked for, in that order."""
        out = self._outputs(into, variables)
        plan = self._route_rows(rows or {})
        picked = self._row_outputs(rows or {})
        calls = []
        for ps, held in enumerate(self._shards):
            shards = [s for s in held if s.variable.name in out]
            request = ps_pb2.PullRequest(
                id=self.identity(ps),
                names=[s.name for s in shards],
                min_step=min_step,
                selections=self._selections(plan[ps]),
            )
            sinks = [*self._dense_sinks(shards, out), *self._row_sinks(plan[ps], picked)]
            calls.append((sinks, request))
        replies = self._packed_calls("PullPacked", calls)
        return min(r.step for r in replies), {**out, **picked}

    def _packed_calls(
        self, method: str, calls: Sequence[tuple[list[Sink], Any]]
    ) -> list[ps_pb2.PushReply]:
        """Runs a unary packed call on every ps at once and hands each tensor of the replies
        to its sink. A transient failure is retried with the same request (a push keeps its
        push_id, so it is applied once)."""

        def one(ps: int) -> ps_pb2.PushReply:
            sinks, request = calls[ps]
            raw: bytes = self._retrying(
                ps, lambda: self._call(ps, method, lambda: self._calls[ps][method](request))
            )
            return self._unpack(ps, raw, sinks, method=method)

        return self._each(one)

    def _unpack(
        self, ps: int, raw: bytes, sinks: Sequence[Sink], *, method: str
    ) -> ps_pb2.PushReply:
        """Hands a packed reply's tensors to their sinks; returns its push outcome (PushPull)."""
        try:
            decoded = codec.decode(raw)
            header = decoded.frame.header
            self._seen(ps, header.id)
            specs = [spec for spec, _ in sinks]
            got = [(t.name, tuple(t.shape), t.dtype) for t in header.tensors]
            want = [(s.name, s.shape, s.dtype.name) for s in specs]
            if got != want:
                raise streams.StreamError(f"{method}: ps sent {got}, asked for {want}")
            views = streams.unpack(decoded.data, specs, where=f"{method} reply")
        except (codec.CodecError, streams.StreamError) as err:
            raise PsClientError(
                ps=ps, address=self.addresses[ps], method=method, code=None, details=str(err)
            ) from err
        for (spec, sink), view in zip(sinks, views, strict=True):
            sink(np.frombuffer(view, dtype=spec.dtype).reshape(spec.shape))
        return ps_pb2.PushReply(
            id=header.id, accepted=header.accepted, step=header.step, reason=header.reason
        )

    def _dense_sinks(self, shards: Sequence[Shard], out: Mapping[str, np.ndarray]) -> list[Sink]:
        return [
            (
                self._stream_spec(s),
                functools.partial(np.copyto, self._shard_view(out[s.variable.name], s)),
            )
            for s in shards
        ]

    def pull_tree(self, layout: Layout, *, min_step: int = 0) -> tuple[int, Any]:
        step, named = self.pull(min_step=min_step)
        return step, layout.unflatten(named)

    def push_tree(self, grads: Any, *, step: int) -> list[ps_pb2.PushReply]:
        _, named = named_leaves(grads)
        return self.push(named, step=step)

    # --- sparse -----------------------------------------------------------------------------

    def sparse_pull(
        self, rows: Mapping[str, np.ndarray], *, min_step: int = 0
    ) -> dict[str, np.ndarray]:
        """The given rows (any order, duplicates allowed) of embedding variables."""
        plan = self._route_rows(rows)
        out = self._row_outputs(rows)

        def one(ps: int) -> None:
            picks = plan[ps]
            if not picks:
                return
            request = ps_pb2.SparsePullRequest(
                id=self.identity(ps), min_step=min_step, selections=self._selections(picks)
            )
            sinks = self._row_sinks(picks, out)
            got: list[np.ndarray | None] = [None] * len(picks)
            self._receive(
                ps,
                "SparsePull",
                start=lambda: self._calls[ps]["SparsePull"](request),
                specs=[spec for spec, _ in sinks],
                into=got,
                keep=got,
            )
            for (_, sink), values in zip(sinks, got, strict=True):
                assert values is not None
                sink(values)

        self._each(one)
        return out

    def sparse_push(
        self,
        grads: Mapping[str, tuple[np.ndarray, np.ndarray]],
        *,
        step: int,
        push_id: str | None = None,
    ) -> list[ps_pb2.PushReply]:
        """Pushes gradient rows {variable: (row ids, rows)}; duplicate ids are summed by the ps."""
        plan = self._route_rows({name: ids for name, (ids, _) in grads.items()})
        push_id = push_id or uuid.uuid4().hex

        def one(ps: int) -> ps_pb2.PushReply | None:
            if not plan[ps]:
                return None
            specs, values = self._row_parts(plan[ps], grads)
            header = tensor_pb2.FrameHeader(
                id=self.identity(ps), step=step, push_id=push_id, tensors=specs
            )
            frames = streams.frames(
                header, (streams.byte_view(v) for v in values), chunk_bytes=self._chunk_bytes
            )
            reply: ps_pb2.PushReply = self._call(
                ps, "SparsePush", lambda: self._calls[ps]["SparsePush"](frames)
            )
            self._seen(ps, reply.id)
            return reply

        with self._push():
            return [r for r in self._each(one) if r is not None]

    def _row_outputs(self, rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Empty arrays for the asked rows of each table."""
        return {
            name: np.empty(
                (len(ids), *self._variables[name].shape[1:]),
                dtype=streams.dtype_of(self._variables[name].dtype),
            )
            for name, ids in rows.items()
        }

    @staticmethod
    def _selections(picks: Sequence[RowPick]) -> list[ps_pb2.RowSelection]:
        return [
            ps_pb2.RowSelection(name=s.name, rows=local.astype("<i8").tobytes())
            for s, local, _ in picks
        ]

    @staticmethod
    def _row_sinks(picks: Sequence[RowPick], out: Mapping[str, np.ndarray]) -> list[Sink]:
        """Per pick, the spec of the rows a ps sends and where they go in `out`."""
        sinks: list[Sink] = []
        for s, local, where in picks:
            spec = streams.Spec(
                s.name, (local.size, *s.shape[1:]), streams.dtype_of(s.variable.dtype)
            )
            sinks.append((spec, functools.partial(_put_rows, out[s.variable.name], where)))
        return sinks

    @staticmethod
    def _row_parts(
        picks: Sequence[RowPick], grads: Mapping[str, tuple[np.ndarray, np.ndarray]]
    ) -> tuple[list[tensor_pb2.TensorSpec], list[np.ndarray]]:
        """The specs (with their row ids) and values of the gradient rows one ps gets."""
        values = [
            np.ascontiguousarray(
                np.asarray(grads[s.variable.name][1])[where],
                dtype=streams.dtype_of(s.variable.dtype),
            )
            for s, _, where in picks
        ]
        specs = [
            streams.Spec(s.name, v.shape, v.dtype).to_proto(rows=local.astype("<i8").tobytes())
            for (s, local, _), v in zip(picks, values, strict=True)
        ]
        return specs, values

    def _route_rows(self, rows: Mapping[str, np.ndarray]) -> list[list[RowPick]]:
        """Per ps: (shard, shard-local row ids, positions in the caller's id array)."""
        plan: list[list[RowPick]] = [[] for _ in self.addresses]
        for name, given in rows.items():
            variable = self._variables.get(name)
            if variable is None or not variable.shape:
                raise KeyError(f"sparse rows: {name!r} is not a variable with rows")
            ids = np.asarray(given, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= variable.shape[0]):
                raise IndexError(f"sparse rows: {name!r} has rows 0..{variable.shape[0] - 1}")
            for shard in self.placement.shards_of(name):
                where = np.flatnonzero((ids >= shard.start) & (ids < shard.stop))
                if where.size:
                    plan[shard.ps].append((shard, ids[where] - shard.start, where))
        return plan

    # --- helpers ----------------------------------------------------------------------------

    def _receive(
        self,
        ps: int,
        method: str,
        *,
        start: Callable[[], Iterator[bytes]],
        specs: Sequence[streams.Spec],
        into: Sequence[np.ndarray | None],
        keep: list[np.ndarray | None] | None = None,
    ) -> int:
        """Reads one reply stream into `into` (or new arrays, stored in `keep`); its step."""

        def read() -> int:
            replies = start()
            header, first = streams.read_header(replies)
            self._seen(ps, header.id)
            got = [(t.name, tuple(t.shape), t.dtype) for t in header.tensors]
            want = [(s.name, s.shape, s.dtype.name) for s in specs]
            if got != want:
                raise streams.StreamError(f"{method}: ps sent {got}, asked for {want}")
            assembler = streams.Assembler(specs, into=into)
            if specs:
                assembler.add(first)
            for decoded in streams.decode_all(replies):
                assembler.add(decoded)
            missing = assembler.missing()
            if missing:
                raise streams.StreamError(f"{method}: stream ended before {', '.join(missing)}")
            if keep is not None:
                keep[:] = [assembler.array(i) for i in range(len(specs))]
            return header.step

        try:
            return self._call(ps, method, read)
        except streams.StreamError as err:
            raise PsClientError(
                ps=ps, address=self.addresses[ps], method=method, code=None, details=str(err)
            ) from err

    def _outputs(
        self, into: Mapping[str, np.ndarray] | None, variables: Collection[str] | None
    ) -> dict[str, np.ndarray]:
        out = {}
        for var in self.placement.variables:
            if variables is not None and var.name not in variables:
                continue
            dtype = streams.dtype_of(var.dtype)
            given = into.get(var.name) if into else None
            if given is not None and (
                given.shape != var.shape
                or given.dtype != dtype
                or not given.flags.c_contiguous
                or not given.flags.writeable
            ):
                raise ValueError(
                    f"pull into: {var.name!r} must be a writable C-contiguous "
                    f"{dtype.name}{list(var.shape)} array"
                )
            out[var.name] = given if given is not None else np.empty(var.shape, dtype=dtype)
        return out

    @staticmethod
    def _spec(shard: Shard) -> tensor_pb2.TensorSpec:
        return tensor_pb2.TensorSpec(name=shard.name, shape=shard.shape, dtype=shard.variable.dtype)

    @staticmethod
    def _stream_spec(shard: Shard) -> streams.Spec:
        return streams.Spec(shard.name, shard.shape, streams.dtype_of(shard.variable.dtype))

    @staticmethod
    def _shard_view(array: np.ndarray, shard: Shard) -> np.ndarray:
        flat = array.reshape(-1).view(np.uint8)
        part = flat[shard.byte_offset : shard.byte_offset + shard.nbytes]
        return part.view(array.dtype).reshape(shard.shape)

    def _named_arrays(
        self, values: Mapping[str, Any], *, what: str, variables: Collection[str] | None = None
    ) -> dict[str, np.ndarray]:
        out = {}
        for var in self.placement.variables:
            if variables is not None and var.name not in variables:
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

    @staticmethod
    def _buffers(arrays: Mapping[str, np.ndarray], shards: Sequence[Shard]) -> Iterator[memoryview]:
        for shard in shards:
            view = streams.byte_view(arrays[shard.variable.name])
            yield view[shard.byte_offset : shard.byte_offset + shard.nbytes]

    def close(self) -> None:
        self._unregister()
        self._pool.shutdown(wait=True)
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> PsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
