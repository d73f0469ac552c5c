"""How a client's calls to one ps travel: the one place that chooses the path.

Read and Update go on the bulk path (`bulk.Peer`) once the ps's bulk port is known (its Status
says it), whatever their size: it also answers a small call in a third of grpc's time. Every
other call, and every call while no port is known or after the bulk connection failed, goes
on gRPC (`rpc.ServiceSpec.call`): a Frame-stream call packed when its tensor bytes and its
reply's fit one chunk, streamed otherwise. Either way a reply's tensors are read straight into
the caller's arrays (`streams.receive`), so the caller never knows which path a call took.

Not thread-safe: one call at a time (a client gives each ps its own thread).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
from google.protobuf import message as protobuf

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire import bulk, rpc, streams
from jaxps_runtime.wire.credentials import TaskCredentials

SERVICE = rpc.PARAMETER_SERVER


class Transport:
    """One channel and one bulk peer to one ps, for the life of its client."""

    def __init__(
        self,
        address: str,
        credentials: TaskCredentials | None = None,
        *,
        use_bulk: bool = True,
        chunk_bytes: int = streams.CHUNK_BYTES,
    ) -> None:
        """`use_bulk=False` keeps every call on gRPC."""
        self.channel = rpc.channel(address, credentials)
        self.bulk = bulk.Peer(address, credentials, enabled=use_bulk)
        self._calls = SERVICE.callables(self.channel)
        self._chunk_bytes = chunk_bytes
        self.data_calls = self.bulk_calls = 0  # Read and Update calls answered; on the bulk path

    def unary(
        self,
        method: str,
        request: protobuf.Message,
        *,
        timeout: float | None = None,
        wait_for_ready: bool | None = None,
    ) -> Any:
        """A call of one message each way (Init, Save, Shutdown, ...), on gRPC."""
        return self._calls[method](request, timeout=timeout, wait_for_ready=wait_for_ready)

    def status(
        self, request: ps_pb2.StatusRequest, *, timeout: float | None, wait_for_ready: bool
    ) -> ps_pb2.StatusReply:
        """The ps's Status, which says where its bulk path listens (0: it has none)."""
        reply: ps_pb2.StatusReply = self.unary(
            "Status", request, timeout=timeout, wait_for_ready=wait_for_ready
        )
        self.bulk.learn(reply.bulk_port)
        return reply

    def send(
        self, method: str, header: tensor_pb2.FrameHeader, buffers: Sequence[memoryview]
    ) -> Any:
        """A call that sends tensors and gets one message back (Assign), on gRPC."""
        return SERVICE.call(
            self._calls, method, header=header, buffers=buffers, chunk_bytes=self._chunk_bytes
        )

    def exchange(
        self,
        method: str,
        message: protobuf.Message,
        *,
        buffers: Sequence[memoryview] = (),
        expect: Sequence[streams.Spec],
        into: Sequence[np.ndarray],
        check: Callable[[tensor_pb2.FrameHeader], None],
        up_to: Collection[int] = (),
    ) -> tuple[tensor_pb2.FrameHeader, list[np.ndarray]]:
        """A call answered by tensors (Read, Update): sends `message` (the request, or the
        header of `buffers`), then reads the reply's header, which `check` sees before a byte
        of its tensors is read, and each tensor of `expect` (the first ones into `into`, the
        rest into new arrays; those of `up_to` may come with fewer rows). Raises
        `grpc.RpcError` (`bulk.BulkError` alike) or `streams.StreamError`."""
        reply = self._start(method, message, buffers, reply_bytes=sum(s.nbytes for s in expect))
        try:
            header, assembler, fill = streams.receive(
                reply,
                into=[*into, *[None] * (len(expect) - len(into))],
                where=method,
                expect=expect,
                up_to=up_to,
            )
            check(header)
            for _ in fill:
                pass
        finally:
            if isinstance(reply, streams.Direct):
                reply.close()  # its connection goes back to the pool, or is closed
        self.data_calls += 1
        self.bulk_calls += isinstance(reply, streams.Direct)
        missing = assembler.missing()
        if missing:
            raise streams.StreamError(f"{method}: stream ended before {', '.join(missing)}")
        return header, [assembler.array(i) for i in range(len(expect))]

    def _start(
        self,
        method: str,
        message: protobuf.Message,
        buffers: Sequence[memoryview],
        *,
        reply_bytes: int,
    ) -> streams.Direct | Any:
        """Sends the call on the bulk path when it can take it, else on gRPC; its reply."""
        if self.bulk.port and method in bulk.NUMBERS:
            return self.bulk.call(method, message.SerializeToString(), buffers)
        frames = SERVICE.methods[method].request is None
        return SERVICE.call(
            self._calls,
            method,
            header=message if frames else None,  # type: ignore[arg-type]
            request=None if frames else message,
            buffers=buffers,
            reply_bytes=reply_bytes,
            chunk_bytes=self._chunk_bytes,
        )

    def close(self) -> None:
        """Ends every call in flight (they fail) and every connection."""
        self.bulk.close()
        self.channel.close()
