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
            transport.Transport uses it for every Read and Update

A call that cannot use it (no port known, or the connection failed: the port is forgotten until
the next Status) goes over gRPC, which always works. With the task's credentials the socket is
mutual TLS against the job's CA and every call passes `authz.admit`, the gate of its gRPC twin.

The rooms: `protocol` (the bytes on the socket, `BulkError`), `limits` (what a peer may hold:
connections, time, bytes), `calls` and `server` (the ps's end), `peer` (the client's end).
Thread-safe.
"""

from jaxps_runtime.wire.bulk.limits import (
    FRAME_SECONDS,
    HANDSHAKE_SECONDS,
    MAX_CONNECTIONS,
    MAX_MESSAGE_BYTES,
    MAX_PEER_CONNECTIONS,
    ROWS_PER_TENSOR,
    SMALL_MESSAGE_BYTES,
    Bounds,
)
from jaxps_runtime.wire.bulk.peer import Peer
from jaxps_runtime.wire.bulk.protocol import HELLO, NUMBERS, READ, UPDATE, BulkError
from jaxps_runtime.wire.bulk.server import BulkServer
from jaxps_runtime.wire.credentials import split_host

__all__ = [
    "FRAME_SECONDS",
    "HANDSHAKE_SECONDS",
    "HELLO",
    "MAX_CONNECTIONS",
    "MAX_MESSAGE_BYTES",
    "MAX_PEER_CONNECTIONS",
    "NUMBERS",
    "READ",
    "ROWS_PER_TENSOR",
    "SMALL_MESSAGE_BYTES",
    "UPDATE",
    "Bounds",
    "BulkError",
    "BulkServer",
    "Peer",
    "split_host",
]
