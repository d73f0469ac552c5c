"""The ps's end of the bulk path: a listener, a thread per connection (the TLS handshake, the
hello, the handover to sealed records, then its calls, `calls.Calls`), within `limits.Limits`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from jaxps_runtime.wire import authz, streams
from jaxps_runtime.wire.bulk import protocol, sealed
from jaxps_runtime.wire.bulk.calls import Calls
from jaxps_runtime.wire.bulk.limits import (
    HANDSHAKE_SECONDS,
    MAX_CONNECTIONS,
    Dropped,
    Limits,
)
from jaxps_runtime.wire.credentials import Identity, TaskCredentials

log = logging.getLogger(__package__)

CLOSE_SECONDS = 5.0  # the longest `BulkServer.close` waits for its threads


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
        self._task = task
        self._tls = credentials.ssl_context(server=True) if credentials else None
        self._calls = Calls(
            servicer,
            task=task,
            gate=authz.Gate(job=job, chief=chief) if credentials else None,
            on_call=on_call,
            placed=placed,
            closed=lambda: self.closed,
        )
        self._limits = Limits(task)
        self._listener = _listen(host)
        self.port: int = self._listener.getsockname()[1]
        self.closed = False
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()
        self._acceptor = threading.Thread(
            target=self._accept, name=f"{task}-bulk-accept", daemon=True
        )
        self._reaper = threading.Thread(
            target=self._limits.reap, args=(self._closing,), name=f"{task}-bulk-reap", daemon=True
        )

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
                    self._limits.warn(
                        "all",
                        "full",
                        "refused a bulk connection from %s: %d are open, the most a ps serves "
                        "(bulk.MAX_CONNECTIONS); its client goes on over gRPC",
                        peer[0],
                        MAX_CONNECTIONS,
                    )
                continue
            thread.start()

    def _serve(self, raw: socket.socket, peer: Any) -> None:
        conn, counted, watch = raw, "", None
        try:
            protocol.tune(raw)
            deadline = time.monotonic() + HANDSHAKE_SECONDS  # the handshake and the hello
            raw.settimeout(HANDSHAKE_SECONDS)  # each step of the handshake
            tls = None
            if self._tls is not None:
                tls = self._tls.wrap_socket(raw, server_side=True)  # raw is detached
                conn = self._swap(raw, tls)
            caller = self._caller(conn)  # counted from here: a hello held back holds its place
            counted = self._limits.count(caller.uri if caller else str(peer[0]))
            randoms = sealed.RANDOM_BYTES if tls is not None else 0
            hello = _receive_by(conn, len(protocol.HELLO) + randoms, deadline)
            if hello[: len(protocol.HELLO)] != protocol.HELLO:
                log.debug("%s: bulk connection from %s did not say hello", self._task, peer)
                return
            mine = sealed.draw() if tls is not None else b""
            conn.sendall(protocol.HELLO + mine)
            if tls is not None:
                theirs = hello[len(protocol.HELLO) :]
                conn = self._swap(
                    tls,
                    sealed.hand_over(tls, client_random=theirs, server_random=mine, server=True),
                )
            conn.settimeout(None)  # from here the reaper bounds every wait
            watch = self._limits.watch(conn, counted)
            while not self.closed:
                self._calls.serve(conn, caller, watch)
        except EOFError:
            pass  # the client closed its connection (between calls, or it stopped)
        except Dropped as err:
            self._limits.warn(counted or str(peer[0]), type(err).__name__, "%s", err)
        except TimeoutError as err:
            self._limits.warn(
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
            self._limits.release(counted, watch)

    def _swap(self, old: socket.socket, new: socket.socket) -> socket.socket:
        """`new` takes `old`'s place among the connections `close` ends; `new`."""
        with self._lock:
            self._connections.discard(old)
            self._connections.add(new)
        return new

    @staticmethod
    def _caller(conn: socket.socket) -> Identity | None:
        """The task of a verified peer (mutual TLS), from its certificate's URIs."""
        if not isinstance(conn, ssl.SSLSocket):
            return None
        cert = conn.getpeercert() or {}
        names = cast(Any, cert.get("subjectAltName", ()))
        return authz.peer_identity(value for kind, value in names if kind == "URI")


def _receive_by(conn: socket.socket, size: int, deadline: float) -> bytes:
    """`size` bytes (a few: the hello) from `conn`, all of them before `deadline` (monotonic):
    TimeoutError otherwise, however the peer spaces them; EOFError if it closes first."""
    got = bytearray()
    while len(got) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"its hello was not whole in {HANDSHAKE_SECONDS:.0f} s")
        conn.settimeout(left)
        part = conn.recv(size - len(got))
        if not part:
            raise EOFError(f"the peer closed the connection after {len(got)} of {size} bytes")
        got += part
    return bytes(got)


def _listen(host: str) -> socket.socket:
    """A listener on an ephemeral port of `host` ("", "::" or "0.0.0.0": every interface)."""
    if host in ("", "::", "0.0.0.0"):
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("::", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64
            )
        return socket.create_server(("0.0.0.0", 0), backlog=64)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family, backlog=64)
