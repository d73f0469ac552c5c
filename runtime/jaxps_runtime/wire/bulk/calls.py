"""One call a ps serves on a bulk connection: its prefix and message read within the limits,
the request admitted by `authz.admit` (the gate of its gRPC twin: the caller's role, then the
task its request speaks for must be its own), the `ParameterServicer` method run, the reply or
the error sent. In plaintext nobody has an identity, as on gRPC, and nothing is checked.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire import authz, streams
from jaxps_runtime.wire.bulk import protocol
from jaxps_runtime.wire.bulk.limits import (
    FRAME,
    FRAME_SECONDS,
    IDLE,
    IDLE_SECONDS,
    SMALL_MESSAGE_BYTES,
    SMALL_TENSOR_BYTES,
    Bounds,
    Watch,
)
from jaxps_runtime.wire.credentials import Identity

log = logging.getLogger(__package__)


class _Abort(Exception):  # noqa: N818 (grpc's word: the call is aborted)
    def __init__(self, code: grpc.StatusCode, details: str, reason: str) -> None:
        super().__init__(details)
        self.code, self.details, self.reason = code, details, reason


class _Context:
    """What the servicer uses of a `grpc.ServicerContext`, for one bulk call."""

    def __init__(self, conn: socket.socket, closed: Callable[[], bool]) -> None:
        self._conn, self._closed = conn, closed
        self._reason = ""

    def is_active(self) -> bool:
        return not self._closed() and not protocol.hung_up(self._conn)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._reason = dict(metadata).get(authz.REASON_KEY, "")

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Abort(code, details, self._reason)


class _Incoming(protocol.Socketed):
    """An Update's tensor bytes, read from the connection into the servicer's arrays; no byte
    for `FRAME_SECONDS` drops the connection."""

    def __init__(self, conn: socket.socket, nbytes: int, watch: Watch) -> None:
        super().__init__(conn, tensor_pb2.FrameHeader(), nbytes)
        self._watch = watch

    def _receive(self, view: memoryview) -> None:
        self._watch.wait(FRAME_SECONDS, FRAME)
        protocol.recv_exact(self._conn, view, self._watch)
        self._watch.work()

    def drain(self) -> None:
        """Reads what the servicer did not (a refused or failed call), into scratch."""
        scratch = memoryview(bytearray(min(self.left, 1 << 20)))
        while self.left:
            self.readinto(scratch[: min(self.left, len(scratch))])


class Calls:
    """Serves the calls of one ps's bulk connections with its servicer. Thread-safe (each
    connection's thread serves its own calls)."""

    def __init__(
        self,
        servicer: Any,
        *,
        task: str,
        gate: authz.Gate | None,
        on_call: Callable[[], None],
        placed: Callable[[], Sequence[streams.Spec]],
        closed: Callable[[], bool],
    ) -> None:
        self._servicer = servicer
        self._task = task
        self._gate = gate  # None in plaintext
        self._on_call = on_call  # after each call served whole (the ps counts them)
        self._placed = placed  # the shards the ps holds now, which bound what a call may carry
        self._closed = closed  # whether the server is closing

    def serve(self, conn: socket.socket, caller: Identity | None, watch: Watch) -> None:
        """Serves one call; EOFError when the client closed the connection before it."""
        prefix = bytearray(protocol.PREFIX.size)
        watch.wait(IDLE_SECONDS, IDLE)
        first = conn.recv_into(prefix, protocol.PREFIX.size)
        if not first:
            raise EOFError("closed between calls")
        watch.wait(FRAME_SECONDS, FRAME)  # the prefix and the message: this long in all
        protocol.recv_exact(conn, memoryview(prefix)[first:])
        method, size, nbytes = protocol.PREFIX.unpack(prefix)
        self._bounds(size, nbytes)
        if size > SMALL_MESSAGE_BYTES:
            watch.state = (watch.state[0], FRAME_SECONDS + size / (1 << 20), FRAME)
        message = protocol.recv_bytes(conn, size)
        watch.work()
        incoming = _Incoming(conn, nbytes, watch)
        try:
            reply = self._call(conn, method, message, incoming, caller)
        except _Abort as err:
            incoming.drain()
            body = json.dumps({"details": err.details, "reason": err.reason}).encode()
            watch.wait(FRAME_SECONDS, FRAME)
            protocol.send(conn, err.code.value[0], body, (), watch)
            return
        incoming.drain()
        self._on_call()  # counted before the reply: a caller's next Status sees it
        watch.wait(FRAME_SECONDS, FRAME)
        protocol.send(conn, 0, reply.header.SerializeToString(), reply.buffers, watch)

    def _bounds(self, size: int, nbytes: int) -> None:
        """Drops a call claiming more than the ps's shards could ever need (asked of the
        shards only for a large claim: a step's calls cost nothing here)."""
        if size <= SMALL_MESSAGE_BYTES and nbytes <= SMALL_TENSOR_BYTES:
            return
        Bounds.of(self._placed()).check(size, nbytes)

    def _call(
        self,
        conn: socket.socket,
        method: int,
        message: bytes,
        incoming: _Incoming,
        caller: Identity | None,
    ) -> streams.Reply:
        name = protocol.METHODS.get(method)
        if name is None:
            raise _Abort(grpc.StatusCode.UNIMPLEMENTED, f"no bulk method {method}", "")

        def read() -> Any:  # a Read's request, or an Update's header with its tensor bytes
            try:
                if method == protocol.READ:
                    return ps_pb2.ReadRequest.FromString(message)
                incoming.header = tensor_pb2.FrameHeader.FromString(message)
            except DecodeError:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{name}: not a request", ""
                ) from None
            return incoming

        def task_of(request: Any) -> str:
            return str(request.header.id.task if request is incoming else request.id.task)

        path = f"/{authz.PS_SERVICE}/{name}"
        try:
            request = authz.admit(self._gate, path, caller, read, task_of=task_of)
        except authz.Refused as refused:
            code = grpc.StatusCode[refused.refusal.code]
            raise _Abort(code, refused.refusal.details, "") from None
        if method == protocol.READ and incoming.nbytes:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "Read: a read carries no tensors", "")
        try:
            reply: streams.Reply = getattr(self._servicer, name)(
                request, _Context(conn, self._closed)
            )
        except _Abort:
            raise
        except (OSError, EOFError):
            raise  # the connection broke under the servicer: nobody to answer
        except Exception as err:
            log.exception("%s: bulk %s failed", self._task, name)
            raise _Abort(grpc.StatusCode.INTERNAL, f"{name}: {err}", "") from err
        return reply
