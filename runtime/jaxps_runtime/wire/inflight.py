"""What one caller may hold of a gRPC server: at most `MAX_CALLS` calls at once, and no stream
that keeps a thread waiting for its next message longer than `STREAM_STALL_SECONDS`.

A server has a fixed pool of threads (a ps 64), and each call in flight holds one: a task of the
job (a worker, even the read-only evaluator) that opened calls and never finished them would
leave none for the others, the chief's included. So `InFlight` counts each caller's calls
(by the identity of its certificate) and refuses one past `MAX_CALLS` with RESOURCE_EXHAUSTED
before a byte of it is read; and it watches every client stream, as the bulk path's reaper
does its connections: a stream whose server has waited `STREAM_STALL_SECONDS` for the next
message (the middle of a push whose bytes stopped coming) is cancelled, which ends the handler
with an error and frees what the call held (a reserved step, a claimed batch). Time the server
spends on its own work between messages does not count.

A unary call's message is read by grpc before any of this runs: it can stall a thread until it
is whole (grpc's Python server has no per-message deadline); `rpc.MAX_RECEIVE_BYTES` bounds its
size. Thread-safe.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

log = logging.getLogger(__name__)

# An honest task holds a few calls of a server at once (a push, a read waiting for its step, a
# status poll, the chief's control calls); a ps serves 64 at once.
MAX_CALLS = 16
STREAM_STALL_SECONDS = 30.0
REAP_SECONDS = 1.0
REAPER_IDLE_SECONDS = 10.0


class TooManyCallsError(Exception):
    """The caller has `MAX_CALLS` calls in flight already."""


class Replies:
    """A call's reply stream that calls `done` once, when the stream ends, fails, or is dropped
    unread (grpc drops the replies of a call cancelled before they are sent)."""

    def __init__(self, replies: Iterable[Any], done: Callable[[], None]) -> None:
        self._replies, self._done = iter(replies), done
        self._ended = threading.Lock()

    def __iter__(self) -> Replies:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._replies)
        except BaseException:
            self._end()
            raise

    def _end(self) -> None:
        if self._ended.acquire(blocking=False):
            self._done()

    def __del__(self) -> None:
        self._end()


class InFlight:
    """The calls in flight of one server, per caller, and a reaper of stalled streams."""

    def __init__(self, *, most: int = MAX_CALLS, stall: float = STREAM_STALL_SECONDS) -> None:
        self.most, self.stall = most, stall
        self._lock = threading.Lock()
        self._calls: collections.Counter[str] = collections.Counter()
        self._waiting: dict[grpc.ServicerContext, tuple[float, str]] = {}
        self._reaper: threading.Thread | None = None

    def enter(self, who: str) -> None:
        """Counts a call of `who`; `TooManyCallsError` when it has `most` in flight already."""
        with self._lock:
            if self._calls[who] >= self.most:
                raise TooManyCallsError(
                    f"{who} has {self.most} calls in flight here, the most a caller may "
                    "(inflight.MAX_CALLS): finish or cancel one first"
                )
            self._calls[who] += 1

    def leave(self, who: str) -> None:
        with self._lock:
            self._calls[who] -= 1
            if self._calls[who] <= 0:
                del self._calls[who]

    def watched(self, who: str, messages: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """`messages` (a client stream), the call cancelled should the server wait longer than
        `stall` for any one of them."""
        self._start_reaper()
        try:
            while True:
                with self._lock:
                    self._waiting[context] = (time.monotonic(), who)
                try:
                    message = next(messages)
                except StopIteration:
                    return
                finally:
                    with self._lock:
                        self._waiting.pop(context, None)
                yield message
        finally:
            with self._lock:
                self._waiting.pop(context, None)

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None:
                return
            self._reaper = threading.Thread(target=self._reap, name="grpc-stalls", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        """Cancels stalled streams every `REAP_SECONDS`; ends once no stream has waited for
        `REAPER_IDLE_SECONDS` (the next stream starts another)."""
        idle_since = time.monotonic()
        while True:
            time.sleep(REAP_SECONDS)
            now = time.monotonic()
            with self._lock:
                if self._waiting:
                    idle_since = now
                elif now - idle_since > REAPER_IDLE_SECONDS:
                    self._reaper = None
                    return
                stalled = [
                    (context, who)
                    for context, (since, who) in self._waiting.items()
                    if now - since > self.stall
                ]
                for context, _ in stalled:
                    del self._waiting[context]
            for context, who in stalled:
                log.warning(
                    "cancelled a stream of %s: no message for %.0f s in the middle of its call",
                    who,
                    self.stall,
                )
                context.cancel()
