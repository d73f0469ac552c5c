"""gRPC wiring of the jaxps services, derived from their protobuf descriptors.

Each method's streaming kind and message types come from `protos/`. Methods whose request or
reply is `jaxps.v1.Frame` move raw bytes through grpc (no (de)serializer) so that `codec` can
read payloads without copies; every other message goes through protobuf as usual. The same
`ServiceSpec` builds the server's generic handler and the client's callables, so both sides
always agree with the .proto files.

A method that sends or returns a Frame stream is served in two framings: the stream the proto
declares, and its packed twin (`<Method>.packed`: one unary Frame each way carrying every
byte), which costs a third of a stream call in grpc's Python runtime for small tensors, while
streaming is several times faster for megabytes. `call` chooses by size, so neither the client
nor the servicer code knows: the servicer reads a Frame iterator and returns a `streams.Reply`
either way. Both framings are one method to authorization.

Channels lift grpc's 4 MiB receive limit (research pitfall 12); servers take messages up to
`MAX_RECEIVE_BYTES`, what the largest honest Frame needs.

With a task's credentials (`credentials.TaskCredentials`), channels and servers are mutual
TLS against the job's own CA, and a `Guard` makes every method of a service pass `authz.Gate`
before it runs: UNAUTHENTICATED without a jaxps identity, PERMISSION_DENIED for another job or a
role the table does not allow (the reply says nothing about the job; the request is not even
parsed), and PERMISSION_DENIED naming both when the request speaks for another task than the
caller's certificate. A caller with `inflight.MAX_CALLS` calls in flight gets RESOURCE_EXHAUSTED
for the next, and a stream stalled in the middle is cancelled (`inflight`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor, message

from jaxps.v1 import coordinator_pb2, parameter_server_pb2, tensor_pb2
from jaxps_runtime.config import cluster
from jaxps_runtime.wire import authz, codec, inflight, streams
from jaxps_runtime.wire.credentials import Identity, TaskCredentials, split_host

UNLIMITED = -1
# The largest message a server takes (grpc refuses a larger one, RESOURCE_EXHAUSTED, before it
# is read into memory): a Frame carries at most `streams.CHUNK_BYTES` of tensor bytes after
# its header, whose names, shapes and row ids fit in 64 MiB (8M row ids; the bulk path takes
# headers up to `bulk.MAX_MESSAGE_BYTES`); every other message is far smaller. Unlimited, any
# caller the gate would refuse anyway could make a server hold gigabytes per call.
MAX_RECEIVE_BYTES = (64 << 20) + streams.CHUNK_BYTES
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", UNLIMITED),
    ("grpc.max_receive_message_length", UNLIMITED),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # A peer that dies comes back within seconds, on Kubernetes at a new pod IP under the same
    # name: retry the connection often (gRPC's default backoff grows to 2 minutes) and let the
    # resolver look the name up again soon (its default waits 30 s between lookups).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.dns_min_time_between_resolutions_ms", 500),
)
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", UNLIMITED),
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.so_reuseport", 0),
)

REASON_KEY = authz.REASON_KEY
PS_RESTARTED = "ps-restarted"  # the caller saw another incarnation of this ps: re-register

_FRAME = tensor_pb2.Frame.DESCRIPTOR.full_name
PACKED = ".packed"  # the suffix of a Frame method's packed twin


@dataclass(frozen=True)
class MethodSpec:
    """One RPC: its path, its streaming kind and how each side (de)serializes."""

    name: str
    path: str
    client_streaming: bool
    server_streaming: bool
    request: type[message.Message] | None  # None: raw Frame bytes (see `codec`)
    reply: type[message.Message] | None
    method: str = ""  # the proto method's path (authorization); `path` when empty
    packed: bool = False  # the packed twin of a Frame-stream method

    @property
    def authz_path(self) -> str:
        return self.method or self.path

    @property
    def frames_in(self) -> bool:
        """The servicer reads a Frame stream (streamed, or one packed frame)."""
        return self.request is None and (self.client_streaming or self.packed)

    @property
    def frames_out(self) -> bool:
        """The servicer returns a `streams.Reply`, framed here."""
        return self.reply is None and (self.server_streaming or self.packed)

    @property
    def kind(self) -> str:
        """grpc's name for the method kind, such as "stream_unary"."""
        return (
            f"{'stream' if self.client_streaming else 'unary'}_"
            f"{'stream' if self.server_streaming else 'unary'}"
        )


def _message_class(
    desc: descriptor.Descriptor, module_types: Mapping[str, type[message.Message]]
) -> type[message.Message] | None:
    if desc.full_name == _FRAME:
        return None
    return module_types[desc.full_name]


@dataclass(frozen=True)
class ServiceSpec:
    """A service's methods, by name."""

    full_name: str
    methods: Mapping[str, MethodSpec]

    @classmethod
    def from_descriptor(cls, desc: descriptor.ServiceDescriptor, *modules: Any) -> ServiceSpec:
        types: dict[str, type[message.Message]] = {}
        for module in modules:
            for msg_desc in module.DESCRIPTOR.message_types_by_name.values():
                types[msg_desc.full_name] = getattr(module, msg_desc.name)
        methods = {}
        for m in desc.methods:
            spec = MethodSpec(
                name=m.name,
                path=f"/{desc.full_name}/{m.name}",
                client_streaming=m.client_streaming,
                server_streaming=m.server_streaming,
                request=_message_class(m.input_type, types),
                reply=_message_class(m.output_type, types),
            )
            methods[m.name] = spec
            if spec.frames_in or spec.frames_out:
                methods[m.name + PACKED] = MethodSpec(
                    name=m.name + PACKED,
                    path=spec.path + PACKED,
                    client_streaming=False,
                    server_streaming=False,
                    request=spec.request,
                    reply=spec.reply,
                    method=spec.path,
                    packed=True,
                )
        return cls(full_name=desc.full_name, methods=methods)

    def generic_handler(
        self, servicer: object, *, guard: Guard | None = None
    ) -> grpc.GenericRpcHandler:
        """A handler routing every method to the servicer's method of the same name, each call
        checked by `guard` first when there is one."""
        implements = {name.removesuffix(PACKED) for name in self.methods}
        missing = [name for name in implements if not callable(getattr(servicer, name, None))]
        if missing:
            raise TypeError(f"{type(servicer).__name__} does not implement {', '.join(missing)}")
        handlers = {}
        for name, spec in self.methods.items():
            make = getattr(grpc, f"{spec.kind}_rpc_method_handler")
            behavior = _framed(spec, getattr(servicer, name.removesuffix(PACKED)))
            parse = spec.request.FromString if spec.request else None
            if guard is None:
                handlers[name] = make(
                    behavior,
                    request_deserializer=parse,
                    response_serializer=spec.reply.SerializeToString if spec.reply else None,
                )
            else:  # the caller is checked before a byte of its request is parsed
                handlers[name] = make(
                    guard.wrap(spec, behavior, parse=parse),
                    response_serializer=spec.reply.SerializeToString if spec.reply else None,
                )
        return grpc.method_handlers_generic_handler(self.full_name, handlers)

    def call(
        self,
        calls: Mapping[str, Callable[..., Any]],
        method: str,
        *,
        header: tensor_pb2.FrameHeader | None = None,
        buffers: Sequence[memoryview] = (),
        request: message.Message | None = None,
        reply_bytes: int = 0,
        chunk_bytes: int = streams.CHUNK_BYTES,
        timeout: float | None = None,
    ) -> Any:
        """Calls `method` on gRPC, packed when its request's tensor bytes (`buffers`, after
        `header`) and the reply's expected ones fit one chunk, streamed otherwise. A
        Frame-stream reply comes back as an iterator of raw frames; read it inside the
        caller's error handling, since grpc reports a failure as the iteration goes. (A
        client's choice between gRPC and the bulk path is `transport`'s.)"""
        spec = self.methods[method]
        packed = max(sum(map(len, buffers)), reply_bytes) <= chunk_bytes
        fn = calls[method + PACKED] if packed else calls[method]
        if spec.request is None:
            assert header is not None, f"{method} sends a Frame stream: give its header"
            if packed:
                request = streams.pack(header, buffers)  # type: ignore[assignment]
            else:
                request = streams.frames(header, buffers, chunk_bytes=chunk_bytes)  # type: ignore[assignment]
        reply = fn(request, timeout=timeout)
        return iter((reply,)) if packed and spec.reply is None else reply

    def callables(self, channel: grpc.Channel) -> dict[str, Callable[..., Any]]:
        """Client callables for every method, bound to `channel`."""
        out: dict[str, Callable[..., Any]] = {}
        for name, spec in self.methods.items():
            factory = getattr(channel, spec.kind)
            out[name] = factory(
                spec.path,
                request_serializer=spec.request.SerializeToString if spec.request else None,
                response_deserializer=spec.reply.FromString if spec.reply else None,
            )
        return out


def _framed(spec: MethodSpec, behavior: Callable[..., Any]) -> Callable[..., Any]:
    """`behavior` (which reads a Frame iterator and returns a `streams.Reply` where the method
    moves Frames) adapted to the method's framing."""
    if not (spec.frames_in or spec.frames_out):
        return behavior

    def framed(request: Any, context: grpc.ServicerContext) -> Any:
        if spec.packed and spec.frames_in:
            request = iter((request,))
        reply = behavior(request, context)
        if not spec.frames_out:
            return reply
        if spec.packed:
            return streams.pack(reply.header, reply.buffers)
        return streams.frames(reply.header, reply.buffers)

    return framed


@dataclass(frozen=True)
class Guard:
    """Authorizes every call of a server by the caller's certificate (mutual TLS only), through
    `authz.admit`, the one path the bulk path's calls pass too; and holds each caller to
    `inflight.MAX_CALLS` calls at once and its streams to no stall (`inflight`)."""

    job: str  # the job's id, as certificates name it
    chief: tuple[str, int]  # (role, index) of the job's chief
    calls: inflight.InFlight = field(default_factory=inflight.InFlight, compare=False)

    def wrap(
        self,
        spec: MethodSpec,
        behavior: Callable[..., Any],
        *,
        parse: Callable[[bytes], Any] | None,
    ) -> Callable[..., Any]:
        """`behavior` behind the gate. A request (raw bytes) is parsed only once the caller's
        role may call the method, then the task it speaks for must be the caller's: for a
        stream, its first message's. A message that does not parse is INVALID_ARGUMENT."""
        gate = authz.Gate(job=self.job, chief=self.chief)
        frames = spec.request is None

        def read(context: grpc.ServicerContext, raw: bytes) -> Any:
            if parse is None:
                return raw
            try:
                return parse(raw)
            except message.DecodeError:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{spec.name}: not a request")

        def task_of(context: grpc.ServicerContext, request: Any) -> str:
            if request is None:
                return ""  # an empty stream speaks for nobody
            if not frames:
                return str(request.id.task)
            try:
                return str(codec.decode(request).frame.header.id.task)
            except codec.CodecError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{spec.name}: {err}")
                raise  # context.abort raises

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            caller = authz.peer_identity(context.peer_identities())
            who = caller.uri if caller is not None else "a caller without identity"
            try:
                self.calls.enter(who)
            except inflight.TooManyCallsError as err:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            try:
                reply = admitted(request, context, caller, who)
            except BaseException:
                self.calls.leave(who)
                raise
            if not spec.server_streaming:
                self.calls.leave(who)
                return reply
            return inflight.Replies(reply, lambda: self.calls.leave(who))  # until all sent

        def admitted(
            request: Any, context: grpc.ServicerContext, caller: Identity | None, who: str
        ) -> Any:
            if spec.client_streaming:
                request = self.calls.watched(who, request, context)

            def first() -> Any:  # the request, or a stream's first message
                raw = next(request, None) if spec.client_streaming else request
                return None if raw is None else read(context, raw)

            try:
                parsed = authz.admit(
                    gate, spec.authz_path, caller, first, task_of=lambda r: task_of(context, r)
                )
            except authz.Refused as refused:
                context.abort(grpc.StatusCode[refused.refusal.code], refused.refusal.details)
            if spec.client_streaming:
                rest = (read(context, r) for r in request)
                return behavior(itertools.chain((parsed,), rest), context)
            return behavior(parsed, context)

        return guarded


def guard(
    spec: cluster.ClusterSpec, *, job: str, credentials: TaskCredentials | None
) -> Guard | None:
    """The guard of a task's server: none in plaintext, where no caller has an identity."""
    if credentials is None:
        return None
    chief = spec.chief_task()
    return Guard(job=job, chief=(chief.type, chief.index))


def add_port(server: grpc.Server, where: str, credentials: TaskCredentials | None) -> int:
    """Listens on `where`: mutual TLS with credentials, else plaintext; the port (0: failed)."""
    if credentials is None:
        port: int = server.add_insecure_port(where)
    else:
        port = server.add_secure_port(where, server_credentials(credentials))
    return port


def server_credentials(credentials: TaskCredentials) -> grpc.ServerCredentials:
    """Serves with the task's server certificate (which names nothing a stranger could use);
    only clients with a certificate of the job's CA complete the handshake."""
    return grpc.ssl_server_credentials(
        [(credentials.key, credentials.server_cert)],
        root_certificates=credentials.ca,
        require_client_auth=True,
    )


PARAMETER_SERVER = ServiceSpec.from_descriptor(
    parameter_server_pb2.DESCRIPTOR.services_by_name["ParameterServer"],
    parameter_server_pb2,
    tensor_pb2,
)
COORDINATOR = ServiceSpec.from_descriptor(
    coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
    coordinator_pb2,
    tensor_pb2,
)


def channel(address: str, credentials: TaskCredentials | None = None) -> grpc.Channel:
    """A channel to a peer with jaxps' options (one per peer, reuse it): mutual TLS with the
    task's credentials (the peer must present a certificate of the job's CA for the address
    dialled: `TaskCredentials.server_name` of its host), plaintext without."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(CHANNEL_OPTIONS))
    tls = grpc.ssl_channel_credentials(
        root_certificates=credentials.ca,
        private_key=credentials.key,
        certificate_chain=credentials.client_cert,
    )
    host = split_host(address)
    name = credentials.server_name(host)
    options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
    if name != host:
        options.append(("grpc.ssl_target_name_override", name))
    return grpc.secure_channel(address, tls, options=options)
