"""The bulk path's bytes on the socket, the same both ways, and the error a call gives.

Wire format (little-endian; one call at a time on a connection, a connection per call in flight):

    hello, each way:  b"JXB1"
    request:  u8 method (1 Read, 2 Update) | u32 message bytes | u64 tensor bytes
              | the ReadRequest or FrameHeader | the tensors' bytes, back to back
    reply:    u8 grpc status code (0: OK) | u32 message bytes | u64 tensor bytes
              | the FrameHeader, or on error JSON {"details", "reason"} | the tensors' bytes

A server reads a request's tensor bytes to the end before it replies, also when it refused the
call, so that neither side blocks writing while the other writes.
"""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Sequence

import grpc

from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire import authz, streams
from jaxps_runtime.wire.bulk.limits import Watch

HELLO = b"JXB1"
READ, UPDATE = 1, 2
METHODS = {READ: "Read", UPDATE: "Update"}
NUMBERS = {name: number for number, name in METHODS.items()}
PREFIX = struct.Struct("<BIQ")
COALESCE_BYTES = 64 << 10  # a call this small is sent in one write
STATUS = {code.value[0]: code for code in grpc.StatusCode}
_HUNG_UP = select.POLLHUP | select.POLLERR | select.POLLRDHUP | select.POLLNVAL


class BulkError(grpc.RpcError):  # type: ignore[misc]  # grpc has no type stubs
    """A call on the bulk path failed; reads like the `grpc.RpcError` of its gRPC twin."""

    def __init__(self, code: grpc.StatusCode, details: str, *, reason: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._reason = code, details, reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((authz.REASON_KEY, self._reason),) if self._reason else ()


def recv_exact(conn: socket.socket, view: memoryview, watch: Watch | None = None) -> None:
    """Fills `view` from `conn`; EOFError if the peer closed first. Each byte that arrives
    tells `watch` the connection moved."""
    got, total = 0, len(view)
    while got < total:
        n = conn.recv_into(view[got:], total - got)
        if watch is not None:
            watch.moved()
        if not n:
            raise EOFError(f"the peer closed the connection after {got} of {total} bytes")
        got += n


def recv_bytes(conn: socket.socket, size: int) -> bytes:
    """`size` bytes from `conn`, memory taken as they arrive (a peer that only claims a large
    message gets no large buffer)."""
    buf = bytearray()
    while len(buf) < size:
        part = bytearray(min(size - len(buf), 1 << 20))
        recv_exact(conn, memoryview(part))
        buf += part
    return bytes(buf)


def send(
    conn: socket.socket,
    first: int,
    message: bytes,
    buffers: Sequence[memoryview],
    watch: Watch | None = None,
) -> None:
    """Sends a prefix, `message` and `buffers`; with a `watch`, in pieces of at most 1 MiB,
    each telling it the connection moved. A call of at most `COALESCE_BYTES` in all goes in
    one write (one sealed record under TLS: a small step's calls pay one system call and one
    record each way, not one per tensor)."""
    nbytes = sum(map(len, buffers))
    prefix = PREFIX.pack(first, len(message), nbytes)
    if len(message) + nbytes <= COALESCE_BYTES:
        if watch is not None:
            watch.moved()
        conn.sendall(b"".join([prefix, message, *buffers]))
        return
    conn.sendall(prefix + message)
    for buf in buffers:
        if watch is None:
            if len(buf):
                conn.sendall(buf)
            continue
        for start in range(0, len(buf), 1 << 20):
            watch.moved()
            conn.sendall(buf[start : start + (1 << 20)])


def hung_up(conn: socket.socket) -> bool:
    """Whether the peer closed `conn` (or it failed), without reading from it."""
    poller = select.poll()
    poller.register(conn.fileno(), _HUNG_UP)
    return bool(poller.poll(0))


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A peer gone without a FIN (its node lost) is noticed as gRPC's keepalive would.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


class Socketed(streams.Direct):
    """A message's `nbytes` tensor bytes still in the connection, read in order (`left`: not
    read yet)."""

    def __init__(self, conn: socket.socket, header: tensor_pb2.FrameHeader, nbytes: int) -> None:
        self._conn = conn
        self.header, self.nbytes, self.left = header, nbytes, nbytes

    def readinto(self, view: memoryview) -> None:
        if len(view) > self.left:
            raise streams.StreamError(f"read past the {self.nbytes} bytes the message carries")
        self._receive(view)
        self.left -= len(view)

    def _receive(self, view: memoryview) -> None:
        recv_exact(self._conn, view)
