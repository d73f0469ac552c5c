"""The client side of the ps tier: `read` and `update` whole models across every ps, in parallel.

One channel per ps, reused for the life of the client; the calling thread talks to ps 0 and one
long-lived pool thread to each other ps, so all ps tasks transfer at once. Each ps gets one
Read or Update call per operation, dense shards and embedding rows together; the transport
(`rpc.ServiceSpec.call`) frames it packed or streamed by size. A read writes each received
window straight into the final array of its variable (a shard is a contiguous byte range of
its variable); an update sends byte ranges of the gradient arrays without copying them first.

Thread-safety: one call at a time per client (pull, push and the rest share per-ps streams'
executor and the incarnations the client has seen). Use one client per thread of work.

Stopping (`stopping`): once the task is told to stop, the client ends its calls in flight by
closing its channels, except that a push in flight first gets `stopping.PUSH_GRACE_SECONDS` to
finish (on every ps, not only some); no push and no Shutdown starts afterwards, retries and waits
end, and every call raises `stopping.Stopped` instead of `PsClientError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Protocol, TypeVar

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.client.placement import Layout, Placement, Shard
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.process import stopping
from jaxps_runtime.wire import bulk, rpc, streams
from jaxps_runtime.wire.credentials import TaskCredentials
from jaxps_runtime.wire.terms import Mode

log = logging.getLogger(__name__)
T = TypeVar("T")
# Rows of one table on one shard: (shard, shard-local row ids, positions in the caller's ids).
RowPick = tuple[Shard, np.ndarray, np.ndarray]
# Transient failures are retried after these pauses; a ps that restarted answers
# FAILED_PRECONDITION on the next try, which goes to the caller at once.
RETRY_BACKOFF = (0.1, 0.3, 0.9)
# After UNAVAILABLE, the first look at whether the channel connects again comes this much later
# (no spinning while the old connection is still being torn down).
RECONNECT_PAUSE = 0.05
# How often `wait_ready` asks every ps for its state.
READY_POLL_SECONDS = 0.05
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class _HasCursors(Protocol):
    @property
    def cursors(self) -> Mapping[str, int]: ...


def merged_cursors(
    replies: Sequence[_HasCursors],
    *,
    how: Callable[[Iterable[int]], int],
) -> dict[str, int]:
    """The workers' data cursors the ps tasks report, merged over them by `how` (a worker
    one ps has not heard of is at 0 there). `max` is where a worker goes on from: a push is
    sent to every ps, so any ps that counted it saw its batch used. `min` is the cursor every
    ps's part of a checkpoint covers."""
    workers = sorted({w for r in replies for w in r.cursors})
    return {w: how(r.cursors.get(w, 0) for r in replies) for w in workers}


class PsClientError(RuntimeError):
    """A ps refused or failed a call; says which ps, where, and what it answered."""

    def __init__(
        self,
        *,
        ps: int,
        address: str,
        method: str,
        code: grpc.StatusCode | None,
        details: str,
        reason: str = "",
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
        self.reason = reason  # the ps's `jaxps-reason` (`terms.REFUSALS`, ...), "" without


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
        use_bulk: bool = True,
    ) -> None:
        """`use_bulk=False` keeps every call on gRPC (see `bulk`)."""
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
        self._bulk = [bulk.Peer(a, credentials, enabled=use_bulk) for a in addresses]
        self.data_calls = self.bulk_calls = 0  # Read and Update calls answered; on the bulk path
        self._counting = threading.Lock()
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
            reason = str(dict(err.trailing_metadata() or ()).get(rpc.REASON_KEY, ""))
            cls = PsRestartedError if reason == rpc.PS_RESTARTED else PsClientError
            raise cls(
                ps=ps,
                address=self.addresses[ps],
                method=method,
                code=code,
                details=details,
                reason=reason,
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
        self._close_connections()

    def _close_connections(self) -> None:
        for peer in self._bulk:
            peer.close()
        for channel in self._channels:
            channel.close()

    def _retrying(self, ps: int, fn: Callable[[], T]) -> T:
        """Runs fn, again after a backoff when the failure looks transient (the peer did not
        answer). Callers make fn idempotent: a push is retried with the same push_id.

        After UNAVAILABLE the backoff ends early once the channel to the ps connects again: a
        restarted ps listens before it has loaded and holds the calls that reach it meanwhile,
        so a retry sent as soon as it listens is answered as soon as it can be."""
        for attempt in range(len(RETRY_BACKOFF) + 1):
            try:
                return fn()
            except PsClientError as err:
                if err.code not in TRANSIENT or attempt == len(RETRY_BACKOFF):
                    raise
                log.debug("%s: %s; retrying in %.1f s", self.task, err, RETRY_BACKOFF[attempt])
                if err.code == grpc.StatusCode.UNAVAILABLE:
                    self._reconnected(ps, within=RETRY_BACKOFF[attempt])
                else:
                    self._stop.sleep(RETRY_BACKOFF[attempt])
        raise AssertionError("unreachable")

    def _reconnected(self, ps: int, *, within: float) -> None:
        """Waits `within` seconds, or less if the channel to `ps` connects again first."""
        deadline = time.monotonic() + within
        self._stop.sleep(min(within, RECONNECT_PAUSE))
        ready = grpc.channel_ready_future(self._channels[ps])
        try:
            while time.monotonic() < deadline:
                self._stop.check()
                try:
                    ready.result(timeout=min(0.1, max(deadline - time.monotonic(), 0.0)))
                    return
                except grpc.FutureTimeoutError:
                    continue
        finally:
            ready.cancel()

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
        self._bulk[ps].learn(reply.bulk_port)
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
            self._stop.sleep(READY_POLL_SECONDS)

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
        tables: Collection[str] | None = None,
    ) -> None:
        """Declares every ps's shards and mode, then streams their initial values (chief only).

        With `params` None the shards are only declared: `restore` fills them from a checkpoint.
        `tables`: the variables workers update by rows (embedding tables, `Task.tables`); each
        ps then refuses rows of any other shard and whole gradients of these. None declares
        nothing (a ps then takes either kind of update of any shard).
        """
        self.epoch = epoch
        mode = mode or Mode()
        arrays = self._named_arrays(params, what="params") if params is not None else None

        def one(ps: int) -> None:
            shards = self._shards[ps]
            request = ps_pb2.InitRequest(
                id=self.identity(ps),
                tensors=[self._declared_spec(s, tables) for s in shards],
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
            assigned = self._call(
                ps,
                "Assign",
                lambda: rpc.PARAMETER_SERVER.call(
                    self._calls[ps],
                    "Assign",
                    header=header,
                    buffers=list(self._buffers(arrays, shards)),
                    chunk_bytes=self._chunk_bytes,
                ),
            )
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

    # --- data -----------------------------------------------------------------------------

    def read(
        self,
        *,
        min_step: int = 0,
        into: Mapping[str, np.ndarray] | None = None,
        variables: Collection[str] | None = None,
        rows: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[int, dict[str, np.ndarray]]:
        """Every variable whole (or those of `variables`) and the `rows` asked for of tables
        ({variable: row ids}, any order, duplicates allowed), all of one ps read at one step;
        and the lowest step among the ps tasks.

        `into` (for instance the arrays of the previous read, once they are no longer used)
        receives the values in place: a training loop that reuses its buffers saves the page
        faults of 2 x model size of fresh memory per step. The values hold each table of `rows`
        as the rows asked for, in that order.
        """
        out = self._outputs(into, variables)
        plan = self._route_rows(rows or {})
        picked = self._row_outputs(rows or {})

        def one(ps: int) -> int:
            shards = [s for s in self._shards[ps] if s.variable.name in out]
            picks = plan[ps]
            request = ps_pb2.ReadRequest(
                id=self.identity(ps),
                names=[s.name for s in shards],
                min_step=min_step,
                selections=[
                    ps_pb2.RowSelection(name=s.name, rows=local.astype("<i8").tobytes())
                    for s, local, _ in picks
                ],
            )
            expect = [*map(self._stream_spec, shards), *self._row_specs(picks)]
            header, values = self._retrying(
                ps,
                lambda: self._receive(
                    ps,
                    "Read",
                    lambda: rpc.PARAMETER_SERVER.call(
                        self._calls[ps],
                        "Read",
                        request=request,
                        reply_bytes=sum(s.nbytes for s in expect),
                        chunk_bytes=self._chunk_bytes,
                        bulk_peer=self._bulk_peer(ps),
                    ),
                    expect=expect,
                    into=[self._shard_view(out[s.variable.name], s) for s in shards],
                ),
            )
            for (s, _, where), got in zip(picks, values[len(shards) :], strict=True):
                picked[s.variable.name][where] = got
            return header.step

        return min(self._each(one)), {**out, **picked}

    def update(
        self,
        grads: Mapping[str, Any],
        *,
        step: int,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
        variables: Collection[str] | None = None,
        push_id: str | None = None,
        cursor: int = 0,
        then_read: bool = False,
        min_step: int = 0,
        into: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[int, dict[str, np.ndarray], list[tensor_pb2.FrameHeader]]:
        """Pushes one gradient to every ps at once: every variable's (or those of `variables`)
        whole, and gradient `rows` of tables ({variable: (row ids, rows)}; duplicate ids are
        summed by the ps), with the worker's data `cursor` once it counts. With `then_read`,
        each ps replies with the values of the same dense variables once it reached `min_step`
        (into `into`, as `read`): one round trip for a sync step and the next step's read.

        Every ps gets the update, even one holding none of its tensors, so that each counts
        it. A transient failure is retried with the same push_id, so it is applied once.
        Returns (the lowest step among the replies, the values read, each ps's reply header:
        `accepted`, `reason`, `step`).
        """
        arrays = self._named_arrays(grads, what="gradients", variables=variables)
        out = self._outputs(into, arrays) if then_read else {}
        plan = self._route_rows({name: ids for name, (ids, _) in (rows or {}).items()})
        push_id = push_id or uuid.uuid4().hex

        def one(ps: int) -> tensor_pb2.FrameHeader:
            shards = [s for s in self._shards[ps] if s.variable.name in arrays]
            specs, values = self._row_parts(plan[ps], rows or {})
            header = tensor_pb2.FrameHeader(
                id=self.identity(ps),
                step=step,
                push_id=push_id,
                tensors=[*(self._spec(s) for s in shards), *specs],
                cursor=cursor,
                then_read=then_read,
                min_step=min_step,
            )
            buffers = [*self._buffers(arrays, shards), *map(streams.byte_view, values)]
            expect = [self._stream_spec(s) for s in shards] if then_read else []
            reply, _ = self._retrying(
                ps,
                lambda: self._receive(
                    ps,
                    "Update",
                    lambda: rpc.PARAMETER_SERVER.call(
                        self._calls[ps],
                        "Update",
                        header=header,
                        buffers=buffers,
                        reply_bytes=sum(s.nbytes for s in expect),
                        chunk_bytes=self._chunk_bytes,
                        bulk_peer=self._bulk_peer(ps),
                    ),
                    expect=expect,
                    into=[self._shard_view(out[s.variable.name], s) for s in shards if out],
                ),
            )
            return reply

        with self._push():
            replies = self._each(one)
        return min(r.step for r in replies), out, replies

    def pull_tree(self, layout: Layout, *, min_step: int = 0) -> tuple[int, Any]:
        step, named = self.read(min_step=min_step)
        return step, layout.unflatten(named)

    def _row_outputs(self, rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Empty arrays for the asked rows of each table."""
        return {
            name: streams.empty(
                (len(ids), *self._variables[name].shape[1:]),
                streams.dtype_of(self._variables[name].dtype),
            )
            for name, ids in rows.items()
        }

    @staticmethod
    def _row_specs(picks: Sequence[RowPick]) -> list[streams.Spec]:
        """The specs of the rows a ps sends for `picks`."""
        return [
            streams.Spec(s.name, (local.size, *s.shape[1:]), streams.dtype_of(s.variable.dtype))
            for s, local, _ in picks
        ]

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
                raise KeyError(f"rows: {name!r} is not a variable with rows")
            ids = np.asarray(given, dtype=np.int64).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= variable.shape[0]):
                raise IndexError(f"rows: {name!r} has rows 0..{variable.shape[0] - 1}")
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
        start: Callable[[], Iterator[bytes]],
        *,
        expect: Sequence[streams.Spec],
        into: Sequence[np.ndarray],
    ) -> tuple[tensor_pb2.FrameHeader, list[np.ndarray]]:
        """Calls `start` and reads its reply stream: the header and each expected tensor (the
        first ones into `into`, the rest as they come)."""

        def read() -> tuple[tensor_pb2.FrameHeader, list[np.ndarray]]:
            stream = start()
            try:
                header, assembler, fill = streams.receive(
                    stream,
                    into=[*into, *[None] * (len(expect) - len(into))],
                    where=method,
                    expect=expect,
                )
                self._seen(ps, header.id)
                for _ in fill:
                    pass
            finally:
                if isinstance(stream, streams.Direct):
                    stream.close()  # its connection goes back to the pool, or is closed
            with self._counting:  # calls to several ps run on several threads
                self.data_calls += 1
                self.bulk_calls += isinstance(stream, streams.Direct)
            missing = assembler.missing()
            if missing:
                raise streams.StreamError(f"{method}: stream ended before {', '.join(missing)}")
            return header, [assembler.array(i) for i in range(len(expect))]

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
            out[var.name] = given if given is not None else streams.empty(var.shape, dtype)
        return out

    @staticmethod
    def _spec(shard: Shard) -> tensor_pb2.TensorSpec:
        return tensor_pb2.TensorSpec(name=shard.name, shape=shard.shape, dtype=shard.variable.dtype)

    @staticmethod
    def _declared_spec(shard: Shard, tables: Collection[str] | None) -> tensor_pb2.TensorSpec:
        """The spec of a shard in Init, saying how pushes update it when `tables` is known: its
        row count (by rows) or `streams.UPDATED_WHOLE`, as one little-endian int64."""
        spec = PsClient._spec(shard)
        if tables is not None:
            table = shard.variable.name in tables and shard.shape
            rows = shard.shape[0] if table else streams.UPDATED_WHOLE
            spec.rows = np.array([rows], "<i8").tobytes()
        return spec

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

    def _bulk_peer(self, ps: int) -> bulk.Peer:
        """The bulk path to `ps`; its port asked for again (Status) when it was lost, as when
        the ps restarted, at most every few seconds. Until then calls go over gRPC."""
        peer = self._bulk[ps]
        if peer.wants_port():
            with contextlib.suppress(PsClientError):
                self.status(ps, timeout=5)
        return peer

    def close(self) -> None:
        if self.data_calls:
            log.info(
                "%s: %d of %d reads and updates went on the bulk path",
                self.task,
                self.bulk_calls,
                self.data_calls,
            )
        self._unregister()
        self._pool.shutdown(wait=True)
        self._close_connections()

    def __enter__(self) -> PsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
