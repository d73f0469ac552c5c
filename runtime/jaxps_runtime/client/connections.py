"""A client's connections to every ps of a job: one `transport.Transport` each, the incarnation
each ps answered with, retries of transient failures, and the end of every call once the task
is told to stop.

The calling thread talks to ps 0 and one long-lived pool thread to each other ps (`each`), so
all ps tasks transfer at once. Thread-safety: one call of `each` at a time (the transports and
incarnations are shared by its threads, one ps each).

Stopping (`stopping`): once the task is told to stop, the calls in flight end by closing the
connections, except that a push in flight (`push`) first gets `stopping.PUSH_GRACE_SECONDS` to
finish (on every ps, not only some); no push starts afterwards, retries and waits end, and
every call raises `stopping.Stopped` instead of `PsClientError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import message as protobuf

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.client.errors import PsClientError, PsLayoutError, PsRestartedError
from jaxps_runtime.process import stopping
from jaxps_runtime.wire import rpc, streams
from jaxps_runtime.wire.credentials import TaskCredentials
from jaxps_runtime.wire.transport import Transport

log = logging.getLogger(__name__)
T = TypeVar("T")
# Transient failures are retried after these pauses; a ps that restarted answers
# FAILED_PRECONDITION on the next try, which goes to the caller at once.
RETRY_BACKOFF = (0.1, 0.3, 0.9)
# After UNAVAILABLE, the first look at whether the channel connects again comes this much later
# (no spinning while the old connection is still being torn down).
RECONNECT_PAUSE = 0.05
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class Connections:
    """The transports to every ps of a job, in ps order."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        job_id: str,
        task: str,
        credentials: TaskCredentials | None,
        use_bulk: bool,
        chunk_bytes: int,
        stop: stopping.Stop,
    ) -> None:
        self.addresses = tuple(addresses)
        self.job_id, self.task = job_id, task
        self.incarnations = [0] * len(addresses)
        self._transports = [
            Transport(a, credentials, use_bulk=use_bulk, chunk_bytes=chunk_bytes) for a in addresses
        ]
        self._pool = ThreadPoolExecutor(len(addresses), thread_name_prefix=f"{task}-ps")
        self._stop = stop
        self._pushes = threading.Condition()
        self._pushing = 0  # pushes in flight
        self._cancelled = False  # the connections are closed (or about to be): the task stops
        self._unregister = stop.callback(self._cancel)

    @property
    def data_calls(self) -> int:
        """Read and Update calls answered."""
        return sum(t.data_calls for t in self._transports)

    @property
    def bulk_calls(self) -> int:
        """Read and Update calls answered on the bulk path."""
        return sum(t.bulk_calls for t in self._transports)

    def each(self, fn: Callable[[int], T]) -> list[T]:
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

    def unary(
        self,
        ps: int,
        method: str,
        request: protobuf.Message,
        *,
        timeout: float | None = None,
        wait_for_ready: bool | None = None,
    ) -> Any:
        """A call of one message each way to `ps`."""
        transport = self._transports[ps]
        return self.call(
            ps,
            method,
            lambda: transport.unary(
                method, request, timeout=timeout, wait_for_ready=wait_for_ready
            ),
        )

    def status(
        self, ps: int, *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> ps_pb2.StatusReply:
        """The Status of `ps` (which also tells its transport where its bulk path listens)."""
        request = ps_pb2.StatusRequest(id=tensor_pb2.Identity(job_id=self.job_id, task=self.task))
        transport = self._transports[ps]
        reply: ps_pb2.StatusReply = self.call(
            ps,
            "Status",
            lambda: transport.status(request, timeout=timeout, wait_for_ready=wait_for_ready),
        )
        return reply

    def assign(
        self, ps: int, header: tensor_pb2.FrameHeader, buffers: Sequence[memoryview]
    ) -> None:
        """Sends `ps` the values of the shards `header` names (Init's Assign), which must then
        hold every shard it declared."""
        transport = self._transports[ps]
        assigned = self.call(ps, "Assign", lambda: transport.send("Assign", header, buffers))
        if assigned.missing:
            raise PsClientError(
                ps=ps,
                address=self.addresses[ps],
                method="Assign",
                code=None,
                details=f"still missing {list(assigned.missing)}",
            )

    def exchange(
        self,
        ps: int,
        method: str,
        message: protobuf.Message,
        *,
        buffers: Sequence[memoryview] = (),
        expect: Sequence[streams.Spec],
        into: Sequence[np.ndarray],
        up_to: Collection[int] = (),
    ) -> tuple[tensor_pb2.FrameHeader, list[np.ndarray]]:
        """A Read or Update of `ps` (`Transport.exchange`), retried when the failure looks
        transient; a reply from another incarnation of the ps than before is
        `PsRestartedError` before any of its tensors is read."""

        def once() -> tuple[tensor_pb2.FrameHeader, list[np.ndarray]]:
            transport = self._transports[ps]
            if transport.bulk.wants_port():  # lost, as when the ps restarted: ask for it again
                with contextlib.suppress(PsClientError):
                    self.status(ps, timeout=5)
            return transport.exchange(
                method,
                message,
                buffers=buffers,
                expect=expect,
                into=into,
                up_to=up_to,
                check=lambda header: self.seen(ps, header.id),
            )

        def answered() -> tuple[tensor_pb2.FrameHeader, list[np.ndarray]]:
            try:
                return self.call(ps, method, once)
            except streams.StreamError as err:
                cls = PsLayoutError if isinstance(err, streams.LayoutError) else PsClientError
                raise cls(
                    ps=ps, address=self.addresses[ps], method=method, code=None, details=str(err)
                ) from err

        return self.retrying(ps, answered)

    def call(self, ps: int, method: str, fn: Callable[[], T]) -> T:
        """fn(), its gRPC or bulk failure raised as `PsClientError` (`PsRestartedError` when
        the ps says it is another incarnation), or as `stopping.Stopped` once stopping."""
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

    def retrying(self, ps: int, fn: Callable[[], T]) -> T:
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
        ready = grpc.channel_ready_future(self._transports[ps].channel)
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

    def seen(self, ps: int, identity: tensor_pb2.Identity) -> None:
        """Adopts the incarnation `ps` answered with; `PsRestartedError` if it changed."""
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

    @contextlib.contextmanager
    def push(self) -> Iterator[None]:
        """Marks a push in flight: `_cancel` lets it finish before closing the connections."""
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
        self._close_transports()

    def _close_transports(self) -> None:
        for transport in self._transports:
            transport.close()

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
        self._close_transports()
