"""Attacks on the wire by a task of the job itself: real processes, real mutual TLS.

A job trains (async, 1 ps, 2 workers) while this test process, holding the job's own
certificates, speaks for other tasks, holds bulk connections half-sent, opens more of them than
a peer may, sends a header naming 10,001 shards and fuzzes the bulk frame parser. Each attack
is refused (or its connection closed) within a bounded time, nothing of it is recorded, and
the ps serves the job throughout.
"""

from __future__ import annotations

import random
import select
import socket
import ssl
import struct
import time
from collections.abc import Iterator

import grpc
import pytest
from cryptography import x509

from jaxps.v1 import coordinator_pb2 as co_pb2
from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire import bulk, credentials, rpc, streams
from jaxps_runtime.wire.bulk import sealed
from tests.process import harness
from tests.process.waiting import wait_for

# one pytest-xdist worker runs the whole module: its module-scoped processes start once
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("test_attacks_wire")]
JOB = "attacked-job"
TRAINING = {
    "model": {"name": "mlp"},
    "mode": "async",
    "steps": 1_000_000,  # trains while the tests run; stopped after
    "batchSize": 32,
    "optimizer": {"name": "sgd", "kwargs": {"learning_rate": 0.01}},
    "logEverySeconds": 1,
}
PREFIX = struct.Struct("<BIQ")
HUGE_CURSOR = 10**12


class Job:
    """The attacked job: its ps-0's address and bulk port, and its tasks' credentials."""

    def __init__(self, job: harness.LocalJob) -> None:
        self.job = job
        self.ps0 = job.spec["ps"][0]
        self.coordinator = job.spec["worker"][0]  # worker 0 is the chief: no chief task
        self.creds = {
            name: credentials.TaskCredentials.load(job.tls_dir(name))
            for name in ("worker-0", "worker-1", "ps-0")
        }
        self.channel = rpc.channel(self.ps0, self.creds["worker-0"])
        self.calls = rpc.PARAMETER_SERVER.callables(self.channel)

    def status(self) -> ps_pb2.StatusReply:
        request = ps_pb2.StatusRequest(id=tensor_pb2.Identity(job_id=JOB, task="worker-0"))
        reply: ps_pb2.StatusReply = self.calls["Status"](request, timeout=10)
        return reply

    def identity(self, task: str) -> tensor_pb2.Identity:
        reply = self.status()
        return tensor_pb2.Identity(
            job_id=JOB,
            task=task,
            ps_incarnation=reply.id.ps_incarnation,
            cluster_epoch=reply.id.cluster_epoch,
        )

    def ps_log(self) -> str:
        return (self.job.log_dir / "ps-0.log").read_text()

    def trains_on(self, *, steps: int = 5, timeout: float = 60) -> None:
        """The ps's step moves on by `steps`: the job's workers are still served."""
        start = self.status().step
        wait_for(
            lambda: self.status().step >= start + steps,
            self.job,
            timeout=timeout,
            what=f"ps-0's step to move on from {start}",
        )
        assert self.job.processes["ps-0"].poll() is None


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    log_dir = tmp_path_factory.mktemp("attacked")
    # A fuzzed update that still parses is pushed with worker-0's own credentials: applied, as
    # any gradient of a job's worker is, and one whose flipped bytes made it huge or NaN took
    # the model to a NaN loss (Diverged: the job stopped training under the next test). That
    # is what rolling back is for: the poisoned step is undone and its batch skipped.
    training = TRAINING | {
        "onDivergence": "rollback",
        "maxRollbacks": 1000,
        "checkpoint": {"dir": str(log_dir / "checkpoints"), "everySteps": 1000},
    }
    job = harness.LocalJob.start(
        training=training,
        log_dir=log_dir,
        job_id=JOB,
        ps=1,
        workers=2,
        tls=True,
    )
    try:
        running = Job(job)

        def ready() -> bool:
            try:
                return running.status().state == ps_pb2.READY and running.status().step > 0
            except grpc.RpcError:
                return False

        wait_for(ready, job, timeout=180, what="ps-0 READY and trained by the workers")
        yield running
        running.channel.close()
    finally:
        job.stop()


def tls_connection(
    port: int, creds: credentials.TaskCredentials, *, hello: bool = True
) -> socket.socket | None:
    """A bulk connection as a task of the job opens it, handed over to sealed records (with
    `hello`; else the TLS session before the hello); None when the ps closed it at once."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn = creds.ssl_context(server=False).wrap_socket(
        raw, server_hostname=creds.server_name("127.0.0.1")
    )
    if not hello:
        return conn
    try:
        mine = sealed.draw()
        conn.sendall(bulk.HELLO + mine)
        answer = conn.recv(len(bulk.HELLO) + sealed.RANDOM_BYTES)
        if answer[: len(bulk.HELLO)] == bulk.HELLO:
            theirs = answer[len(bulk.HELLO) :]
            return sealed.hand_over(conn, client_random=mine, server_random=theirs, server=False)
    except (OSError, ValueError):
        pass
    conn.close()
    return None


def closed_by_peer(conn: socket.socket) -> bool:
    try:
        return conn.recv(1 << 16) == b""
    except (ssl.SSLWantReadError, BlockingIOError):
        return False
    except OSError:
        return True


def wait_closed(conns: list[socket.socket], *, within: float) -> float:
    """Waits until the ps closed every connection; the seconds it took (fails past `within`)."""
    started = time.monotonic()
    open_ = list(conns)
    while open_:
        left = started + within - time.monotonic()
        assert left > 0, f"{len(open_)} of {len(conns)} connections still open after {within} s"
        readable, _, _ = select.select(open_, [], [], min(left, 1.0))
        for conn in readable:
            conn.setblocking(False)
            if closed_by_peer(conn):
                open_.remove(conn)
    return time.monotonic() - started


def zero_update(
    running: Job, *, task: str, cursor: int, shard: str = ""
) -> tuple[tensor_pb2.FrameHeader, list[memoryview]]:
    """A well-formed push of zero gradients to every shard of ps-0, speaking for `task`; with
    `shard`, as the batch `cursor - 1` of that data shard."""
    reply = running.status()
    header = tensor_pb2.FrameHeader(
        id=running.identity(task),
        step=reply.step,
        tensors=list(reply.tensors),
        push_id=f"attack-{time.monotonic_ns()}",
        shard=shard,
        cursor=cursor,
        lease=1 if shard else 0,
    )
    buffers = [
        memoryview(bytearray(streams.Spec.from_proto(t, where="t").nbytes)) for t in reply.tensors
    ]
    return header, buffers


def test_a_worker_speaking_for_another_worker_is_permission_denied_and_nothing_is_recorded(
    attacked: Job,
) -> None:
    worker0 = attacked.creds["worker-0"]
    header, buffers = zero_update(attacked, task="worker-1", cursor=HUGE_CURSOR, shard="0:0")
    # gRPC: packed and streamed
    for chunk_bytes in (streams.CHUNK_BYTES, 1024):
        with pytest.raises(grpc.RpcError) as caught:
            list(
                rpc.PARAMETER_SERVER.call(
                    attacked.calls,
                    "Update",
                    header=header,
                    buffers=buffers,
                    chunk_bytes=chunk_bytes,
                    timeout=10,
                )
            )
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'worker-1'" in caught.value.details()
        assert "'worker-0'" in caught.value.details()
    # the bulk path
    peer = bulk.Peer(attacked.ps0, worker0)
    peer.learn(attacked.status().bulk_port)
    with pytest.raises(bulk.BulkError) as refused:
        peer.call("Update", header.SerializeToString(), buffers, timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'worker-1'" in refused.value.details()
    read = ps_pb2.ReadRequest(id=attacked.identity("worker-1"), names=[header.tensors[0].name])
    with pytest.raises(bulk.BulkError) as refused:
        peer.call("Read", read.SerializeToString(), (), timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # its own identity passes the same gate
    read.id.task = "worker-0"
    peer.call("Read", read.SerializeToString(), (), timeout=10).close()
    peer.close()
    # nothing recorded: no data position of the attack, for any shard
    assert HUGE_CURSOR not in attacked.status().cursors.values()
    attacked.trains_on()


def test_a_heartbeat_or_registration_speaking_for_another_task_is_refused(
    attacked: Job,
) -> None:
    with rpc.channel(attacked.coordinator, attacked.creds["worker-1"]) as channel:
        calls = rpc.COORDINATOR.callables(channel)
        other = tensor_pb2.Identity(job_id=JOB, task="worker-0")
        for method, request in (
            ("Heartbeat", co_pb2.HeartbeatRequest(id=other, step=HUGE_CURSOR, done=True)),
            ("Register", co_pb2.RegisterRequest(id=other, task_incarnation=7)),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                calls[method](request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
            assert "'worker-0'" in caught.value.details(), method
            assert "'worker-1'" in caught.value.details(), method
    attacked.trains_on()


def test_half_sent_bulk_frames_are_dropped_within_the_frame_timeout_and_the_ps_serves_on(
    attacked: Job,
) -> None:
    port = attacked.status().bulk_port
    held: list[socket.socket] = []
    for i in range(60):  # two identities: each under its per-peer cap as far as it goes
        conn = tls_connection(port, attacked.creds["worker-1" if i % 2 else "worker-0"])
        if conn is not None:
            conn.sendall(PREFIX.pack(bulk.UPDATE, 100, 0)[:7])  # half a prefix, then nothing
            held.append(conn)
    assert len(held) >= 50  # the ps took them (a cap refuses only beyond its peer's share)
    took = wait_closed(held, within=bulk.FRAME_SECONDS + 10)
    assert took >= bulk.FRAME_SECONDS - 1  # dropped by the timeout, not at once
    for sock in held:
        sock.close()
    wait_for(
        lambda: "bulk.FRAME_SECONDS" in attacked.ps_log(),
        attacked.job,
        timeout=30,
        what="ps-0 to log the dropped connections",
    )
    attacked.trains_on()


def test_bulk_connections_over_a_peers_cap_or_the_total_are_refused_and_others_get_in(
    attacked: Job,
) -> None:
    port = attacked.status().bulk_port
    worker1, worker0 = attacked.creds["worker-1"], attacked.creds["worker-0"]
    held: list[socket.socket] = []
    refused = 0
    for _ in range(bulk.MAX_PEER_CONNECTIONS + 1):
        conn = tls_connection(port, worker1)
        if conn is None:
            refused += 1
        else:
            held.append(conn)
    assert refused >= 1
    assert len(held) <= bulk.MAX_PEER_CONNECTIONS
    # another identity still gets in, and its calls are served
    other = tls_connection(port, worker0)
    assert other is not None
    other.close()
    wait_for(
        lambda: "bulk.MAX_PEER_CONNECTIONS" in attacked.ps_log(),
        attacked.job,
        timeout=30,
        what="ps-0 to log the refused connection",
    )
    attacked.trains_on()  # worker 1, refused on the bulk path, goes on over gRPC
    for sock in held:
        sock.close()

    # the total: connections that never start their handshake count too, until its timeout
    raw = []
    for _ in range(bulk.MAX_CONNECTIONS):
        raw.append(socket.create_connection(("127.0.0.1", port), timeout=30))
    wait_for(
        lambda: (
            "bulk.MAX_CONNECTIONS" in attacked.ps_log()
            or closed_immediately(socket.create_connection(("127.0.0.1", port), timeout=30))
        ),
        attacked.job,
        timeout=30,
        what="a connection over bulk.MAX_CONNECTIONS to be refused",
    )
    wait_for(
        lambda: "bulk.MAX_CONNECTIONS" in attacked.ps_log(),
        attacked.job,
        timeout=30,
        what="ps-0 to log the refused connection",
    )
    for sock in raw:
        sock.close()
    attacked.trains_on()


def test_bulk_connections_holding_back_their_hello_count_at_once_and_are_cut_in_time(
    attacked: Job,
) -> None:
    """A task that may call nothing (a ps) opens more than its share, TLS done, and trickles
    each hello a byte at a time: the connections over its share are closed at once, the
    others once the handshake's time is up, however the bytes are spaced."""
    port = attacked.status().bulk_port
    opened = []
    for _ in range(bulk.MAX_PEER_CONNECTIONS + 4):
        conn = tls_connection(port, attacked.creds["ps-0"], hello=False)
        assert conn is not None
        opened.append(conn)
    started = time.monotonic()
    hello = bulk.HELLO + bytes(sealed.RANDOM_BYTES)
    open_ = list(opened)
    sent = 0
    while open_:
        took = time.monotonic() - started
        assert took < bulk.HANDSHAKE_SECONDS + 10, f"{len(open_)} connections still open"
        for conn in list(open_):
            conn.setblocking(False)
            try:
                if closed_by_peer(conn):
                    open_.remove(conn)
                    continue
                conn.setblocking(True)
                conn.sendall(hello[sent : sent + 1])
            except OSError:
                open_.remove(conn)
        if 2 < took < bulk.HANDSHAKE_SECONDS - 3:  # those over the share are closed already
            assert len(open_) <= bulk.MAX_PEER_CONNECTIONS
        sent = min(sent + 1, len(hello) - 1)  # never the whole hello
        time.sleep(0.5)
    assert time.monotonic() - started >= bulk.HANDSHAKE_SECONDS - 3  # the rest: by the deadline
    for conn in opened:
        conn.close()
    wait_for(
        lambda: (
            "bulk.HANDSHAKE_SECONDS" in attacked.ps_log()
            and "bulk.MAX_PEER_CONNECTIONS" in attacked.ps_log()
        ),
        attacked.job,
        timeout=30,
        what="ps-0 to log both limits",
    )
    attacked.trains_on()


def closed_immediately(conn: socket.socket) -> bool:
    with conn:
        conn.settimeout(2)
        try:
            return conn.recv(1) == b""
        except TimeoutError:
            return False
        except OSError:
            return True


def test_an_update_naming_10001_shards_is_refused_in_linear_time(attacked: Job) -> None:
    names = [f"['nope']/{i}" for i in range(10_000)] + ["['nope']/9999"]  # last: worst
    header = tensor_pb2.FrameHeader(
        id=attacked.identity("worker-0"),
        step=attacked.status().step,
        tensors=[tensor_pb2.TensorSpec(name=n, shape=[1], dtype="float32") for n in names],
    )
    buffers = [memoryview(bytearray(4 * len(names)))]
    peer = bulk.Peer(attacked.ps0, attacked.creds["worker-0"])
    peer.learn(attacked.status().bulk_port)
    took = []
    for _ in range(3):  # the best of three: the machine is shared
        started = time.perf_counter()
        with pytest.raises(bulk.BulkError) as refused:
            peer.call("Update", header.SerializeToString(), buffers, timeout=30)
        took.append(time.perf_counter() - started)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    peer.close()
    assert min(took) < 0.1, took
    attacked.trains_on()


def mutated(frame: bytes, rng: random.Random) -> bytes:
    """`frame` with a few bytes flipped, cut or repeated, or its prefix's sizes changed."""
    data = bytearray(frame)
    kind = rng.randrange(5)
    if kind == 0 and data:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:
        data = data[: rng.randrange(len(data) + 1)]
    elif kind == 2:
        at = rng.randrange(len(data) + 1)
        data[at:at] = data[rng.randrange(len(data) + 1) :][: rng.randint(1, 64)]
    elif kind == 3 and len(data) >= PREFIX.size:
        method, size, nbytes = PREFIX.unpack(data[: PREFIX.size])
        size = rng.choice([0, size + 1, max(size - 1, 0), rng.randrange(1 << 32)])
        nbytes = rng.choice([0, nbytes + 4, max(nbytes - 4, 0), rng.randrange(1 << 64)])
        data[: PREFIX.size] = PREFIX.pack(method, size, nbytes)
    else:
        data[0:1] = bytes([rng.randrange(256)])
    return bytes(data)


def answered_or_closed(conn: socket.socket, *, within: float) -> str:
    """Reads until the ps closes the connection: "closed", or "answered <code>" when a reply's
    prefix came first. Fails when neither happens within `within` seconds."""
    deadline = time.monotonic() + within
    got = b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, "the ps neither answered nor closed the connection"
        conn.settimeout(left)
        try:
            part = conn.recv(1 << 16)
        except OSError:
            part = b""
        if not part:
            break
        got += part
    if len(got) < PREFIX.size:
        return "closed"
    code = PREFIX.unpack(got[: PREFIX.size])[0]
    return f"answered {code or grpc.StatusCode.OK.name}"


def test_fuzzed_bulk_frames_are_answered_or_closed_and_the_ps_serves_on(attacked: Job) -> None:
    rng = random.Random(32)
    worker0 = attacked.creds["worker-0"]
    port = attacked.status().bulk_port
    header, buffers = zero_update(attacked, task="worker-0", cursor=0)
    update = header.SerializeToString()
    read = ps_pb2.ReadRequest(
        id=attacked.identity("worker-0"), names=[t.name for t in header.tensors]
    ).SerializeToString()
    valid = [
        PREFIX.pack(bulk.UPDATE, len(update), sum(map(len, buffers))) + update + b"".join(buffers),
        PREFIX.pack(bulk.READ, len(read), 0) + read,
    ]
    outcomes: dict[str, int] = {}
    for case in range(160):
        if case % 4 == 0:
            frame = rng.randbytes(rng.randrange(1, 512))
        else:
            frame = mutated(rng.choice(valid), rng)
        conn = tls_connection(port, worker0)
        assert conn is not None, f"case {case}: the ps refused a fresh connection"
        with conn:
            try:
                conn.sendall(frame)
                conn.shutdown(socket.SHUT_WR)  # all it sends: a cut frame ends here
            except OSError:
                pass  # the ps closed it already
            outcome = answered_or_closed(conn, within=bulk.FRAME_SECONDS + 10)
        assert outcome != f"answered {grpc.StatusCode.INTERNAL.value[0]}", f"case {case}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert len(outcomes) > 1, outcomes  # the cases reached more than one way out
    assert "Traceback" not in attacked.ps_log()
    peer = bulk.Peer(attacked.ps0, worker0)
    peer.learn(port)
    reply = peer.call("Read", read, (), timeout=10)
    values = bytearray(reply.nbytes)
    reply.readinto(memoryview(values))
    reply.close()
    peer.close()
    attacked.trains_on()


def presented_certificate(port: int) -> x509.Certificate:
    """The certificate a server shows whoever connects, before it is asked for its own."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as raw,
        context.wrap_socket(raw) as conn,  # TLS 1.3: the client's side completes first
    ):
        der = conn.getpeercert(binary_form=True)
    assert der
    return x509.load_der_x509_certificate(der)


def test_a_stranger_learns_neither_the_job_nor_the_task_from_a_ps_certificate(
    attacked: Job,
) -> None:
    worker0 = attacked.creds["worker-0"]
    for port in (int(attacked.ps0.rpartition(":")[2]), attacked.status().bulk_port):
        cert = presented_certificate(port)
        shown = " ".join(
            (
                cert.subject.rfc4514_string(),
                cert.issuer.rfc4514_string(),
                str(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value),
            )
        )
        for secret in (JOB, "ps-0", "/ps/", "jaxps://", "127.0.0.1"):
            assert secret not in shown, (port, secret, shown)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == [worker0.server_name("127.0.0.1")]
    # and the job's own tasks still check it: a client that expects another name is refused
    assert worker0.server_name("127.0.0.1") != worker0.server_name("127.0.0.2")
    attacked.trains_on()
