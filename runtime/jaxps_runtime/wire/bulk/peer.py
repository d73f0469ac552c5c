"""The client's end of the bulk path to one ps: its port, learned from the ps's Status, and a
pool of idle connections to it. A call that cannot use it (no port known, or the connection
failed: the port is forgotten until the next Status) goes over gRPC (`transport` chooses), which
always works. With the task's credentials the socket is mutual TLS against the job's CA
(Python's ssl, with the checks gRPC makes: the server's certificate carries the name of the
host dialled), handed over to sealed records once both ends are proven (`sealed`).
Thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Sequence

import grpc
from google.protobuf.message import DecodeError

from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire.bulk import protocol, sealed
from jaxps_runtime.wire.bulk.limits import IDLE_SECONDS, MAX_MESSAGE_BYTES
from jaxps_runtime.wire.bulk.protocol import BulkError
from jaxps_runtime.wire.credentials import TaskCredentials, split_host

log = logging.getLogger(__package__)

CONNECT_SECONDS = 5.0
RETRY_PORT_AFTER = 2.0  # seconds between Status calls that ask a ps for its bulk port again
# A port whose connection timed out or failed its TLS handshake (a network policy or firewall
# that lets gRPC's port through but not this one) is left alone this long, even when a Status
# names it again; gRPC carries the calls meanwhile.
UNREACHABLE_RETRY_AFTER = 60.0


class Reply(protocol.Socketed):
    """A reply's header and tensor bytes still in the connection; `close` gives the
    connection back once they were all read (or closes it)."""

    def __init__(
        self, peer: Peer, conn: socket.socket, header: tensor_pb2.FrameHeader, nbytes: int
    ) -> None:
        super().__init__(conn, header, nbytes)
        self._peer = peer
        self._broken = False

    def readinto(self, view: memoryview) -> None:
        try:
            super().readinto(view)
        except (OSError, EOFError) as err:
            self._broken = True
            raise self._peer.broke(err) from err

    def close(self) -> None:
        self._peer.give_back(self._conn, reusable=not self._broken and not self.left)


class Peer:
    """The bulk path to one ps: its port (learned from its Status; 0 while unknown) and
    idle connections to it."""

    def __init__(
        self, address: str, credentials: TaskCredentials | None = None, *, enabled: bool = True
    ) -> None:
        self.host = split_host(address)
        self._enabled = enabled  # False: the port is never learned, every call goes on gRPC
        self._tls = credentials.ssl_context(server=False) if credentials and enabled else None
        self._server_name = credentials.server_name(self.host) if credentials else self.host
        self.port = 0
        self._asked = 0.0  # when the client last asked the ps for its port (monotonic)
        self._unreachable = (0, 0.0)  # a port found unreachable, and until when it is left alone
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, float]] = []  # and when each was given back
        self._busy: set[socket.socket] = set()
        self._closed = False

    def learn(self, port: int) -> None:
        """The port the ps said it has (0: none); connections to another port are closed."""
        if not self._enabled:
            return
        with self._lock:
            self._asked = now = time.monotonic()
            if port == self._unreachable[0] and now < self._unreachable[1]:
                return
            if port == self.port:
                return
            self.port, stale, self._idle = port, self._idle, []
        for conn, _ in stale:
            conn.close()

    def wants_port(self) -> bool:
        """Whether to ask the ps for its port now: none known, and not asked just before."""
        return (
            self._enabled
            and not self.port
            and not self._closed
            and time.monotonic() - self._asked > RETRY_PORT_AFTER
        )

    def broke(self, err: BaseException) -> BulkError:
        """The error a broken connection gives; the port is forgotten until the next Status
        (the ps may have restarted elsewhere), and gRPC carries the calls meanwhile."""
        with self._lock:
            self.port = 0
            self._asked = time.monotonic()
        return BulkError(
            grpc.StatusCode.UNAVAILABLE, f"bulk connection to {self.host}: {err or type(err)}"
        )

    def call(
        self,
        method: str,
        message: bytes,
        buffers: Sequence[memoryview],
        *,
        timeout: float | None = None,
    ) -> Reply:
        """Sends one call and reads its reply's header; the tensors are left to the caller
        (`streams.receive`), who then closes the reply."""
        conn = self._take()
        try:
            conn.settimeout(timeout)
            protocol.send(conn, protocol.NUMBERS[method], message, buffers)
            prefix = protocol.recv_bytes(conn, protocol.PREFIX.size)
            code, size, nbytes = protocol.PREFIX.unpack(prefix)
            if size > MAX_MESSAGE_BYTES:
                raise ValueError(f"a {size}-byte reply message")
            body = protocol.recv_bytes(conn, size)
        except (OSError, EOFError, ValueError) as err:
            self.give_back(conn, reusable=False)
            raise self.broke(err) from err
        if code:
            self.give_back(conn, reusable=not nbytes)
            try:
                error = json.loads(body)
                details, reason = str(error["details"]), str(error.get("reason", ""))
            except (ValueError, KeyError, TypeError):
                details, reason = body.decode("utf-8", "replace"), ""
            raise BulkError(
                protocol.STATUS.get(code, grpc.StatusCode.UNKNOWN), details, reason=reason
            )
        try:
            header = tensor_pb2.FrameHeader.FromString(body)
        except DecodeError as err:
            self.give_back(conn, reusable=False)
            raise BulkError(
                grpc.StatusCode.INTERNAL, f"{method}: a reply that does not parse"
            ) from err
        return Reply(self, conn, header, nbytes)

    def _take(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise BulkError(grpc.StatusCode.CANCELLED, "the client is closed")
            port = self.port
            while self._idle:
                conn, since = self._idle.pop()
                if time.monotonic() - since < IDLE_SECONDS / 2 and not protocol.hung_up(conn):
                    self._busy.add(conn)
                    return conn
                conn.close()  # the ps closes it soon, or did
        try:
            conn = self._connect(port)
        except (OSError, EOFError, ValueError) as err:
            if isinstance(err, TimeoutError | ssl.SSLError):
                log.warning(
                    "the bulk path to %s:%d is unreachable (%s); Read and Update go over gRPC, "
                    "slower, and it is tried again in %.0f s",
                    self.host,
                    port,
                    err,
                    UNREACHABLE_RETRY_AFTER,
                )
                self._unreachable = (port, time.monotonic() + UNREACHABLE_RETRY_AFTER)
            raise self.broke(err) from err
        with self._lock:
            if self._closed:
                conn.close()
                raise BulkError(grpc.StatusCode.CANCELLED, "the client is closed")
            self._busy.add(conn)
        return conn

    def _connect(self, port: int) -> socket.socket:
        if not port:
            raise ValueError("no bulk port known")
        conn = socket.create_connection((self.host, port), timeout=CONNECT_SECONDS)
        try:
            protocol.tune(conn)
            mine = sealed.draw() if self._tls is not None else b""
            if self._tls is not None:  # the plain socket is detached: conn is all there is
                conn = self._tls.wrap_socket(conn, server_hostname=self._server_name)
            conn.sendall(protocol.HELLO + mine)
            answer = protocol.recv_bytes(conn, len(protocol.HELLO) + len(mine))
            if answer[: len(protocol.HELLO)] != protocol.HELLO:
                raise ValueError(f"{self.host}:{port} is no jaxps bulk listener")
            if isinstance(conn, ssl.SSLSocket):
                theirs = answer[len(protocol.HELLO) :]
                conn = sealed.hand_over(
                    conn, client_random=mine, server_random=theirs, server=False
                )
        except BaseException:
            conn.close()
            raise
        return conn

    def give_back(self, conn: socket.socket, *, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(conn)
            if reusable and not self._closed and not getattr(conn, "worn", False):
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        """Closes every connection; a call in flight fails (its socket is shut down)."""
        with self._lock:
            self._closed = True
            idle, busy, self._idle = self._idle, list(self._busy), []
        for conn, _ in idle:
            conn.close()
        for conn in busy:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
