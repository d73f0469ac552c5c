"""What a ps's bulk path lets a peer hold: connections, time without a byte moving, bytes.

No peer can hold a ps's resources here. A connection is one thread, and there are at most
`MAX_CONNECTIONS` (in total, handshakes included) and `MAX_PEER_CONNECTIONS` per caller
identity (per address in plaintext), counted from the end of the TLS handshake; one over either
is closed with a warning in the ps's log, and its client goes on over gRPC. The TLS handshake
and the hello after it must be whole `HANDSHAKE_SECONDS` after the connection opened;
then one reaper thread (`Limits.reap`) drops a connection whose call in progress (its tensor
bytes, the reply's sending) went `FRAME_SECONDS` without a byte moving, whose prefix and message
took longer than `FRAME_SECONDS` (and a second per MiB) in all, or that waited `IDLE_SECONDS`
for its next call: the sockets stay blocking, so a call pays no system call for its limits. A
call's message and tensor bytes are at most what the ps's shards could ever need (`Bounds`); a
larger claim closes the connection before anything is allocated or read for it. A peer that
trickles a byte every few seconds is bounded by the caps, not by the timeouts.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxps_runtime.wire import streams

log = logging.getLogger(__package__)  # the bulk path's one logger

MAX_MESSAGE_BYTES = 256 << 20  # a header (row ids included) above this closes the connection
HANDSHAKE_SECONDS = 10.0  # the longest a TLS handshake and hello may stall
# The longest a call in progress may go without a byte moving, either way: half a frame sent
# and nothing more, or a reply its caller does not read. Then the connection is closed.
FRAME_SECONDS = 5.0
# The longest a connection may wait for its next call; a client drops its own idle connections
# after half of it, so that it never sends on one the ps is closing.
IDLE_SECONDS = 60.0
MAX_CONNECTIONS = 256  # open at once, handshakes included; also the most threads serving them
MAX_PEER_CONNECTIONS = 32  # open at once per caller identity (per address in plaintext)
SMALL_MESSAGE_BYTES = 1 << 20  # a message this size needs no look at the ps's shards
SMALL_TENSOR_BYTES = 64 << 20  # nor do tensor bytes this size
ROWS_PER_TENSOR = 1 << 16  # ps.ROWS_PER_TENSOR (a unit test keeps them equal): see `Bounds`
REFUSAL_LOG_SECONDS = 10.0  # one warning per peer and reason this often, however many refusals
REAP_SECONDS = 0.5  # how often the reaper looks for connections past their limit
IDLE, FRAME, WORKING = "idle between calls", "in the middle of a call", "served"


class Dropped(Exception):  # noqa: N818 (the connection is dropped, not an error of ours)
    """A connection closed by a limit; the message says which, for the ps's log."""


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

    def check(self, size: int, nbytes: int) -> None:
        """Drops a call of `size` message and `nbytes` tensor bytes past these bounds."""
        if size > self.message_bytes or nbytes > self.tensor_bytes:
            raise Dropped(
                f"dropped a bulk call of {size} message and {nbytes} tensor bytes: this ps's "
                f"shards need at most {self.message_bytes} and {self.tensor_bytes}"
            )


class Watch:
    """What a served connection's thread waits on, for the reaper (`Limits.reap`): since
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


class Limits:
    """The connections of one ps's bulk path each peer holds, their watches, and the warnings
    that say which limit closed one (once per peer and reason every `REFUSAL_LOG_SECONDS`).
    Thread-safe."""

    def __init__(self, task: str) -> None:
        self._task = task
        self._lock = threading.Lock()
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._warned: dict[tuple[str, str], float] = {}  # (peer, reason) -> last warning
        self._watches: set[Watch] = set()  # of the connections past their handshake

    def count(self, who: str) -> str:
        """Counts a connection of `who` (its identity, or its address), or drops it when `who`
        has `MAX_PEER_CONNECTIONS` open already."""
        with self._lock:
            if self._per_peer[who] >= MAX_PEER_CONNECTIONS:
                raise Dropped(
                    f"refused a bulk connection of {who}: it has {MAX_PEER_CONNECTIONS} open, "
                    "the most a peer may (bulk.MAX_PEER_CONNECTIONS); it goes on over gRPC"
                )
            self._per_peer[who] += 1
        return who

    def watch(self, conn: socket.socket, who: str) -> Watch:
        """The watch of a connection past its handshake, which the reaper now looks at."""
        watch = Watch(conn, who)
        with self._lock:
            self._watches.add(watch)
        return watch

    def release(self, counted: str, watch: Watch | None) -> None:
        """A connection of `counted` ("": not counted) closed."""
        with self._lock:
            if watch is not None:
                self._watches.discard(watch)
            if counted:
                self._per_peer[counted] -= 1
                if not self._per_peer[counted]:
                    del self._per_peer[counted]

    def warn(self, peer: str, reason: str, message: str, *args: Any) -> None:
        """Logs a refusal, once per peer and reason every `REFUSAL_LOG_SECONDS`."""
        now = time.monotonic()
        with self._lock:
            if now - self._warned.get((peer, reason), -math.inf) < REFUSAL_LOG_SECONDS:
                return
            self._warned[(peer, reason)] = now
        log.warning("%s: " + message, self._task, *args)

    def reap(self, closing: threading.Event) -> None:
        """Until `closing`, drops every connection past its limit: `FRAME_SECONDS` without a
        byte moving in the middle of a call, `IDLE_SECONDS` between calls. A watch, not socket
        timeouts, so that a call costs no system call for them."""
        while not closing.wait(REAP_SECONDS):
            now = time.monotonic()
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                since, limit, what = watch.state
                if now - since <= limit or watch.dropped:
                    continue
                watch.dropped = True
                if what == FRAME:
                    self.warn(
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
