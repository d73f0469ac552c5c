"""The bulk path: the ps's Read and Update over a socket of their own, with no user-space copy.

grpc's Python runtime copies every byte of a message twice on each side (into a slice to send;
into a `bytes` on receipt, which jaxps then copies into an aligned array), and hands each
message between threads. Moving 1 GiB over 127.0.0.1 costs about 1.8 CPU-seconds (both ends
together) with grpc and 0.75 over a socket that sends from the arrays and `recv_into`s them. A
dense step is CPU-bound on exactly that (bench/profile_step.py --perf: memcpy, grpc and the
kernel's scheduling are half of all CPU), and a small call costs grpc's Python runtime about
three times what a socket round trip does. So the two data calls travel here: the same
messages (a `ReadRequest`; a `FrameHeader` and the tensors' bytes), the same
`ParameterServicer` methods, the same errors; only the framing differs.

    ps:     BulkServer(servicer, host=..., task=..., job=..., chief=..., credentials=...,
                       placed=store.specs)
            .port goes out in StatusReply.bulk_port
    client: Peer(address, credentials); .learn(port) from each StatusReply;
            rpc.call(..., bulk_peer=peer) uses it for every Read and Update

A call that cannot use it (no port known, or the connection failed: the port is forgotten until
the next Status) goes over gRPC, which always works. With the task's credentials the socket is
mutual TLS against the job's CA (Python's ssl, with the checks gRPC makes: the server's
certificate carries the name of the host dialled, the client's is of the job's CA) and every
call passes `authz.Gate`, the gate of its gRPC twin: the caller's role, then the task its
request speaks for must be its own. In plaintext nobody has an identity, as on gRPC, and nothing
is checked.

No peer can hold a ps's resources here. A connection is one thread, and there are at most
`MAX_CONNECTIONS` (in total, handshakes included) and `MAX_PEER_CONNECTIONS` per caller
identity (per address in plaintext); one over either is closed with a warning in the ps's log,
and its client goes on over gRPC. A handshake may stall `HANDSHAKE_SECONDS` (a socket timeout);
then one reaper thread drops a connection whose call in progress (its tensor bytes, the reply's
sending) went `FRAME_SECONDS` without a byte moving, whose prefix and message took longer than
`FRAME_SECONDS` (and a second per MiB) in all, or that waited `IDLE_SECONDS` for its next call:
the sockets stay blocking, so a call pays no system call for its limits. A call's
message and tensor bytes are at most what the ps's shards could ever need (`Bounds`); a larger
claim closes the connection before anything is allocated or read for it. A peer that trickles
a byte every few seconds is bounded by the caps, not by the timeouts.

Wire format (little-endian; one call at a time on a connection, a connection per call in flight):

    hello, each way:  b"JXB1"
    request:  u8 method (1 Read, 2 Update) | u32 message bytes | u64 tensor bytes
              | the ReadRequest or FrameHeader | the tensors' bytes, back to back
    reply:    u8 grpc status code (0: OK) | u32 message bytes | u64 tensor bytes
              | the FrameHeader, or on error JSON {"details", "reason"} | the tensors' bytes

A server reads a request's tensor bytes to the end before it replies, also when it refused the
call, so that neither side blocks writing while the other writes. Thread-safe.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire import authz, streams
from jaxps_runtime.wire.credentials import Identity, TaskCredentials

log = logging.getLogger(__name__)

HELLO = b"JXB1"
READ, UPDATE = 1, 2
METHODS = {READ: "Read", UPDATE: "Update"}
NUMBERS = {name: number for number, name in METHODS.items()}
PREFIX = struct.Struct("<BIQ")
MAX_MESSAGE_BYTES = 256 << 20  # a header (row ids included) above this closes the connection
HANDSHAKE_SECONDS = 10.0  # the longest a TLS handshake and hello may stall
# The longest a call in progress may go without a byte moving, either way: half a frame sent
# and nothing more, or a reply its caller does not read. Then the connection is closed.
FRAME_SECONDS = 5.0
# The longest a connection may wait for its next call; a client drops its own idle connections
# after half of it, so that it never sends on one the ps is closing.
IDLE_SECONDS = 60.0
CONNECT_SECONDS = 5.0
MAX_CONNECTIONS = 256  # open at once, handshakes included; also the most threads serving them
MAX_PEER_CONNECTIONS = 32  # open at once per caller identity (per address in plaintext)
SMALL_MESSAGE_BYTES = 1 << 20  # a message this size needs no look at the ps's shards
SMALL_TENSOR_BYTES = 64 << 20  # nor do tensor bytes this size
ROWS_PER_TENSOR = 1 << 16  # ps.ROWS_PER_TENSOR (a unit test keeps them equal): see `Bounds`
REFUSAL_LOG_SECONDS = 10.0  # one warning per peer and reason this often, however many refusals
REAP_SECONDS = 0.5  # how often the reaper looks for connections past their limit
IDLE, FRAME, WORKING = "idle between calls", "in the middle of a call", "served"
CLOSE_SECONDS = 5.0  # the longest `BulkServer.close` waits for its threads
RETRY_PORT_AFTER = 2.0  # seconds between Status calls that ask a ps for its bulk port again
# A port whose connection timed out or failed its TLS handshake (a network policy or firewall
# that lets gRPC's port through but not this one) is left alone this long, even when a Status
# names it again; gRPC carries the calls meanwhile.
UNREACHABLE_RETRY_AFTER = 60.0
_HUNG_UP = select.POLLHUP | select.POLLERR | select.POLLRDHUP | select.POLLNVAL
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


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


class _Watch:
    """What a served connection's thread waits on, for the reaper (`BulkServer._reap`): since
    when (monotonic), at most how long, and what. One tuple, so that the reaper never reads
    a new limit with an old start. Written by the connection's thread only."""

    __slots__ = ("conn", "dropped", "state", "who")

    def __init__(self, conn: socket.socket, who: str) -> None:
        self.conn, self.who, self.dropped = conn, who, False
        self.state: tuple[float, float, str] = (time.monotonic(), IDLE_SECONDS, IDLE)

    def wait(self, limit: float, what: str) -> None:
        """From now, at most `limit` seconds without the thread moving on."""
        self.state = (time.monotonic(), limit, what)

    def moved(self) -> None:
        """A byte moved: the limit counts again from now."""
        _, limit, what = self.state
        self.state = (time.monotonic(), limit, what)

    def work(self) -> None:
        """The servicer runs (or waits for other workers' pushes): no limit."""
        self.state = (time.monotonic(), math.inf, WORKING)


def _recv_exact(conn: socket.socket, view: memoryview, watch: _Watch | None = None) -> None:
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


def _recv_bytes(conn: socket.socket, size: int) -> bytes:
    """`size` bytes from `conn`, memory taken as they arrive (a peer that only claims a large
    message gets no large buffer)."""
    buf = bytearray()
    while len(buf) < size:
        part = bytearray(min(size - len(buf), 1 << 20))
        _recv_exact(conn, memoryview(part))
        buf += part
    return bytes(buf)


def _send(
    conn: socket.socket,
    first: int,
    message: bytes,
    buffers: Sequence[memoryview],
    watch: _Watch | None = None,
) -> None:
    """Sends a prefix, `message` and `buffers`; with a `watch`, in pieces of at most 1 MiB,
    each telling it the connection moved."""
    conn.sendall(PREFIX.pack(first, len(message), sum(map(len, buffers))) + message)
    for buf in buffers:
        if watch is None:
            if len(buf):
                conn.sendall(buf)
            continue
        for start in range(0, len(buf), 1 << 20):
            watch.moved()
            conn.sendall(buf[start : start + (1 << 20)])


def _hung_up(conn: socket.socket) -> bool:
    """Whether the peer closed `conn` (or it failed), without reading from it."""
    poller = select.poll()
    poller.register(conn.fileno(), _HUNG_UP)
    return bool(poller.poll(0))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A peer gone without a FIN (its node lost) is noticed as gRPC's keepalive would.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def split_host(address: str) -> str:
    """The host of "host:port" (an IPv6 host without its brackets)."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


# --- the ps side --------------------------------------------------------------------------


class _Abort(Exception):  # noqa: N818 (grpc's word: the call is aborted)
    def __init__(self, code: grpc.StatusCode, details: str, reason: str) -> None:
        super().__init__(details)
        self.code, self.details, self.reason = code, details, reason


class _Context:
    """What the servicer uses of a `grpc.ServicerContext`, for one bulk call."""

    def __init__(self, conn: socket.socket, server: BulkServer) -> None:
        self._conn, self._server = conn, server
        self._reason = ""

    def is_active(self) -> bool:
        return not self._server.closed and not _hung_up(self._conn)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._reason = dict(metadata).get(authz.REASON_KEY, "")

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Abort(code, details, self._reason)


class _Socketed(streams.Direct):
    """A message's `nbytes` tensor bytes still in the connection, read in order (`left`: not
    read yet)."""

    def __init__(
        self,
        conn: socket.socket,
        header: tensor_pb2.FrameHeader,
        nbytes: int,
        watch: _Watch | None = None,
    ) -> None:
        self._conn, self._watch = conn, watch
        self.header, self.nbytes, self.left = header, nbytes, nbytes

    def readinto(self, view: memoryview) -> None:
        if len(view) > self.left:
            raise streams.StreamError(f"read past the {self.nbytes} bytes the message carries")
        if self._watch is None:
            _recv_exact(self._conn, view)
        else:  # a server's read: no byte for FRAME_SECONDS drops the connection
            self._watch.wait(FRAME_SECONDS, FRAME)
            _recv_exact(self._conn, view, self._watch)
            self._watch.work()
        self.left -= len(view)


class _Incoming(_Socketed):
    """An Update's tensor bytes, read from the connection into the servicer's arrays."""

    def drain(self) -> None:
        """Reads what the servicer did not (a refused or failed call), into scratch."""
        scratch = memoryview(bytearray(min(self.left, 1 << 20)))
        while self.left:
            self.readinto(scratch[: min(self.left, len(scratch))])


@dataclass(frozen=True)
class Bounds:
    """The largest call a ps could ever need, from the shards it holds (`streams.Spec`s): each
    tensor of a call carries at most its shard's row count of row ids and rows, or
    `ROWS_PER_TENSOR` if more (ids may repeat: the ps's own bound), twice over, plus 1 MiB of
    names and shapes and 64 MiB of tensor bytes."""

    message_bytes: int
    tensor_bytes: int

    @classmethod
    def of(cls, specs: Sequence[streams.Spec]) -> Bounds:
        ids = values = 0
        for spec in specs:
            rows = spec.shape[0] if spec.shape else 1
            most = max(rows, ROWS_PER_TENSOR)
            ids += 8 * most
            values += most * (spec.nbytes // rows if rows else 0)
        return cls(
            message_bytes=min(SMALL_MESSAGE_BYTES + 2 * ids, MAX_MESSAGE_BYTES),
            tensor_bytes=SMALL_TENSOR_BYTES + 2 * values,
        )


class _Dropped(Exception):  # noqa: N818 (the connection is dropped, not an error of ours)
    """A connection closed by a limit; the message says which, for the ps's log."""


class BulkServer:
    """Serves the bulk path of one ps: a listener on an ephemeral port of `host`, a thread
    per connection, at most `MAX_CONNECTIONS` of them (`MAX_PEER_CONNECTIONS` per caller).
    `close` ends every connection (calls in flight fail UNAVAILABLE). Thread-safe."""

    def __init__(
        self,
        servicer: Any,
        *,
        host: str,
        task: str,
        job: str,
        chief: tuple[str, int],
        credentials: TaskCredentials | None = None,
        on_call: Callable[[], None] = lambda: None,
        placed: Callable[[], Sequence[streams.Spec]] = lambda: (),
    ) -> None:
        self._servicer = servicer
        self._on_call = on_call  # after each call served whole (the ps counts them)
        self._placed = placed  # the shards the ps holds now, which bound what a call may carry
        self._task = task
        self._tls = credentials.ssl_context(server=True) if credentials else None
        self._gate = authz.Gate(job=job, chief=chief) if credentials else None
        if host in ("", "::", "0.0.0.0"):  # all interfaces
            if socket.has_dualstack_ipv6():
                self._listener = socket.create_server(
                    ("::", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64
                )
            else:
                self._listener = socket.create_server(("0.0.0.0", 0), backlog=64)
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, 0), family=family, backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self.closed = False
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._warned: dict[tuple[str, str], float] = {}  # (peer, reason) -> last warning
        self._watches: set[_Watch] = set()  # of the connections past their handshake
        self._closing = threading.Event()
        self._acceptor = threading.Thread(
            target=self._accept, name=f"{task}-bulk-accept", daemon=True
        )
        self._reaper = threading.Thread(target=self._reap, name=f"{task}-bulk-reap", daemon=True)

    def start(self) -> None:
        self._acceptor.start()
        self._reaper.start()

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            self.closed = True
            connections, threads = list(self._connections), list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + CLOSE_SECONDS
        for thread in (self._acceptor, self._reaper, *threads):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def open_connections(self) -> int:
        """Connections open now, handshakes included."""
        with self._lock:
            return len(self._connections)

    def _warn(self, peer: str, reason: str, message: str, *args: Any) -> None:
        """Logs a refusal, once per peer and reason every `REFUSAL_LOG_SECONDS`."""
        now = time.monotonic()
        with self._lock:
            if now - self._warned.get((peer, reason), -math.inf) < REFUSAL_LOG_SECONDS:
                return
            self._warned[(peer, reason)] = now
        log.warning("%s: " + message, self._task, *args)

    def _accept(self) -> None:
        while not self.closed:
            try:
                raw, peer = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._connections) >= MAX_CONNECTIONS
                if not self.closed and not full:
                    self._connections.add(raw)
                    thread = threading.Thread(
                        target=self._serve,
                        args=(raw, peer),
                        name=f"{self._task}-bulk",
                        daemon=True,
                    )
                    self._threads.add(thread)
            if self.closed or full:
                raw.close()
                if full:
                    self._warn(
                        "all",
                        "full",
                        "refused a bulk connection from %s: %d are open, the most a ps serves "
                        "(bulk.MAX_CONNECTIONS); its client goes on over gRPC",
                        peer[0],
                        MAX_CONNECTIONS,
                    )
                continue
            thread.start()

    def _reap(self) -> None:
        """Drops every connection past its limit: `FRAME_SECONDS` without a byte moving in the
        middle of a call, `IDLE_SECONDS` between calls. A watch, not socket timeouts, so that
        a call costs no system call for them."""
        while not self._closing.wait(REAP_SECONDS):
            now = time.monotonic()
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                since, limit, what = watch.state
                if now - since <= limit or watch.dropped:
                    continue
                watch.dropped = True
                if what == FRAME:
                    self._warn(
                        watch.who,
                        "stalled",
                        "dropped a bulk connection of %s: nothing moved for %.0f s %s "
                        "(bulk.FRAME_SECONDS)",
                        watch.who,
                        limit,
                        what,
                    )
                else:
                    log.debug("%s: closed a bulk connection of %s, %s", self._task, watch.who, what)
                with contextlib.suppress(OSError):  # the thread's read or write fails at once
                    socket.socket.shutdown(watch.conn, socket.SHUT_RDWR)

    def _serve(self, raw: socket.socket, peer: Any) -> None:
        conn, counted, watch = raw, "", None
        try:
            _tune(raw)
            raw.settimeout(HANDSHAKE_SECONDS)  # each step of the handshake and the hello
            if self._tls is not None:
                conn = self._tls.wrap_socket(raw, server_side=True)  # raw is detached
                with self._lock:
                    self._connections.discard(raw)
                    self._connections.add(conn)
            if _recv_bytes(conn, len(HELLO)) != HELLO:
                log.debug("%s: bulk connection from %s did not say hello", self._task, peer)
                return
            caller = self._caller(conn)
            counted = self._count(caller.uri if caller else str(peer[0]))
            conn.sendall(HELLO)
            conn.settimeout(None)  # from here the reaper bounds every wait
            watch = _Watch(conn, counted)
            with self._lock:
                self._watches.add(watch)
            while not self.closed:
                self._one(conn, caller, watch)
        except EOFError:
            pass  # the client closed its connection (between calls, or it stopped)
        except _Dropped as err:
            self._warn(counted or str(peer[0]), type(err).__name__, "%s", err)
        except TimeoutError as err:
            self._warn(
                str(peer[0]),
                "handshake",
                "dropped a bulk connection from %s: %s (bulk.HANDSHAKE_SECONDS is %.0f s)",
                peer[0],
                err or "its handshake stalled",
                HANDSHAKE_SECONDS,
            )
        except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
            log.debug("%s: bulk connection from %s: %s", self._task, peer, err)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            raw.close()
            with self._lock:
                self._connections.discard(raw)
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())
                if watch is not None:
                    self._watches.discard(watch)
                if counted:
                    self._per_peer[counted] -= 1
                    if not self._per_peer[counted]:
                        del self._per_peer[counted]

    def _count(self, who: str) -> str:
        """Counts a connection of `who` (its identity, or its address), or drops it when `who`
        has `MAX_PEER_CONNECTIONS` open already."""
        with self._lock:
            if self._per_peer[who] >= MAX_PEER_CONNECTIONS:
                raise _Dropped(
                    f"refused a bulk connection of {who}: it has {MAX_PEER_CONNECTIONS} open, "
                    "the most a peer may (bulk.MAX_PEER_CONNECTIONS); it goes on over gRPC"
                )
            self._per_peer[who] += 1
        return who

    def _caller(self, conn: socket.socket) -> Identity | None:
        if not isinstance(conn, ssl.SSLSocket):
            return None
        cert = conn.getpeercert() or {}
        for kind, value in cast(Any, cert.get("subjectAltName", ())):
            if kind == "URI":
                found = Identity.parse(value)
                if found is not None:
                    return found
        return None

    def _bounds(self, size: int, nbytes: int) -> None:
        """Drops a call claiming more than the ps's shards could ever need (asked of the
        shards only for a large claim: a step's calls cost nothing here)."""
        if size <= SMALL_MESSAGE_BYTES and nbytes <= SMALL_TENSOR_BYTES:
            return
        bounds = Bounds.of(self._placed())
        if size > bounds.message_bytes or nbytes > bounds.tensor_bytes:
            raise _Dropped(
                f"dropped a bulk call of {size} message and {nbytes} tensor bytes: this ps's "
                f"shards need at most {bounds.message_bytes} and {bounds.tensor_bytes}"
            )

    def _one(self, conn: socket.socket, caller: Identity | None, watch: _Watch) -> None:
        """Serves one call; EOFError when the client closed the connection before it."""
        prefix = bytearray(PREFIX.size)
        watch.wait(IDLE_SECONDS, IDLE)
        first = conn.recv_into(prefix, PREFIX.size)
        if not first:
            raise EOFError("closed between calls")
        watch.wait(FRAME_SECONDS, FRAME)  # the prefix and the message: this long in all
        _recv_exact(conn, memoryview(prefix)[first:])
        method, size, nbytes = PREFIX.unpack(prefix)
        self._bounds(size, nbytes)
        if size > SMALL_MESSAGE_BYTES:
            watch.state = (watch.state[0], FRAME_SECONDS + size / (1 << 20), FRAME)
        message = _recv_bytes(conn, size)
        watch.work()
        incoming = _Incoming(conn, tensor_pb2.FrameHeader(), nbytes, watch)
        try:
            reply = self._call(conn, method, message, incoming, caller)
        except _Abort as err:
            incoming.drain()
            body = json.dumps({"details": err.details, "reason": err.reason}).encode()
            watch.wait(FRAME_SECONDS, FRAME)
            _send(conn, err.code.value[0], body, (), watch)
            return
        incoming.drain()
        watch.wait(FRAME_SECONDS, FRAME)
        _send(conn, 0, reply.header.SerializeToString(), reply.buffers, watch)
        self._on_call()

    def _call(
        self,
        conn: socket.socket,
        method: int,
        message: bytes,
        incoming: _Incoming,
        caller: Identity | None,
    ) -> streams.Reply:
        name = METHODS.get(method)
        if name is None:
            raise _Abort(grpc.StatusCode.UNIMPLEMENTED, f"no bulk method {method}", "")
        parsed: list[Any] = []

        def claimed() -> str:
            try:
                if method == READ:
                    parsed.append(ps_pb2.ReadRequest.FromString(message))
                    return str(parsed[0].id.task)
                incoming.header = tensor_pb2.FrameHeader.FromString(message)
            except DecodeError:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{name}: not a request", ""
                ) from None
            parsed.append(incoming)
            return str(incoming.header.id.task)

        if self._gate is None:
            claimed()
        else:
            refused = self._gate.refusal(f"/{authz.PS_SERVICE}/{name}", caller, claimed)
            if refused is not None:
                raise _Abort(grpc.StatusCode[refused.code], refused.details, "")
        if method == READ and incoming.nbytes:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "Read: a read carries no tensors", "")
        context = _Context(conn, self)
        try:
            reply: streams.Reply = getattr(self._servicer, name)(parsed[0], context)
        except _Abort:
            raise
        except (OSError, EOFError):
            raise  # the connection broke under the servicer: nobody to answer
        except Exception as err:
            log.exception("%s: bulk %s failed", self._task, name)
            raise _Abort(grpc.StatusCode.INTERNAL, f"{name}: {err}", "") from err
        return reply


# --- the client side ----------------------------------------------------------------------


class Reply(_Socketed):
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
            _send(conn, NUMBERS[method], message, buffers)
            prefix = _recv_bytes(conn, PREFIX.size)
            code, size, nbytes = PREFIX.unpack(prefix)
            if size > MAX_MESSAGE_BYTES:
                raise ValueError(f"a {size}-byte reply message")
            body = _recv_bytes(conn, size)
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
            raise BulkError(_STATUS.get(code, grpc.StatusCode.UNKNOWN), details, reason=reason)
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
                if time.monotonic() - since < IDLE_SECONDS / 2 and not _hung_up(conn):
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
            _tune(conn)
            if self._tls is not None:  # the plain socket is detached: conn is all there is
                conn = self._tls.wrap_socket(conn, server_hostname=self._server_name)
            conn.sendall(HELLO)
            if _recv_bytes(conn, len(HELLO)) != HELLO:
                raise ValueError(f"{self.host}:{port} is no jaxps bulk listener")
        except BaseException:
            conn.close()
            raise
        return conn

    def give_back(self, conn: socket.socket, *, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(conn)
            if reusable and not self._closed:
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
