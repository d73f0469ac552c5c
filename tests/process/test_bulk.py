"""The bulk path (`jaxps_runtime.wire.bulk`) of real ps processes on 127.0.0.1: what it carries is
what gRPC carries, a peer that breaks its protocol gets a clear refusal or a closed connection
and changes nothing, and a ps killed under a call is an UNAVAILABLE the client retries."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.client import placement
from jaxps_runtime.client.psclient import PsClient, PsClientError
from jaxps_runtime.config import cluster
from jaxps_runtime.config import training as config
from jaxps_runtime.wire import bulk, streams
from tests.process import harness

# one pytest-xdist worker runs the whole module: its module-scoped processes start once
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("test_bulk")]
JOB_ID = "test-job"
SGD_1 = config.OptimizerConfig("sgd", {"learning_rate": 1.0})
PREFIX = struct.Struct("<BIQ")


@pytest.fixture(scope="module")
def one_ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.LocalPs]:
    running = harness.LocalPs.start(1, job_id=JOB_ID, log_dir=tmp_path_factory.mktemp("logs"))
    yield running
    running.stop()


def _client(ps: harness.LocalPs, tree: dict[str, np.ndarray], epoch: int) -> PsClient:
    layout = placement.plan(placement.variables_of(tree), num_ps=len(ps.addresses))
    client = PsClient(addresses=ps.addresses, placement=layout, job_id=JOB_ID, task="chief-0")
    _, named = placement.named_leaves(tree)
    client.init(named, optimizer=SGD_1, epoch=epoch)
    return client


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn.sendall(bulk.HELLO)
    assert conn.recv(len(bulk.HELLO), socket.MSG_WAITALL) == bulk.HELLO
    return conn


def _call(
    conn: socket.socket, method: int, message: bytes, payload: bytes = b""
) -> tuple[int, bytes, bytes]:
    """One raw call; (status code, reply message, tensor bytes)."""
    conn.sendall(PREFIX.pack(method, len(message), len(payload)) + message + payload)
    code, size, nbytes = PREFIX.unpack(conn.recv(PREFIX.size, socket.MSG_WAITALL))
    body = conn.recv(size, socket.MSG_WAITALL) if size else b""
    data = conn.recv(nbytes, socket.MSG_WAITALL) if nbytes else b""
    return code, body, data


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_peer_breaking_the_protocol_is_refused_and_changes_nothing(
    one_ps: harness.LocalPs,
) -> None:
    client = _client(one_ps, {"w": np.zeros(1 << 18, np.float32)}, epoch=1)
    port = client.status(0).bulk_port
    assert port
    shard = client.placement.shards[0]
    ident = client.identity(0)
    spec = tensor_pb2.TensorSpec(name=shard.name, shape=list(shard.shape), dtype="float32")
    header = tensor_pb2.FrameHeader(id=ident, push_id="p", tensors=[spec])
    ones = np.ones(shard.shape, np.float32).tobytes()
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    refusals = {  # each on one connection, which serves the next call after the refusal
        "fewer bytes than the tensors": (bulk.UPDATE, header.SerializeToString(), ones[:-4]),
        "more bytes than the tensors": (bulk.UPDATE, header.SerializeToString(), ones + ones),
        "a header that does not parse": (bulk.UPDATE, b"\xff\xff\xff", ones),
        "a read carrying bytes": (
            bulk.READ,
            ps_pb2.ReadRequest(id=ident, names=[shard.name]).SerializeToString(),
            b"1234",
        ),
        "an unknown shard": (
            bulk.UPDATE,
            tensor_pb2.FrameHeader(
                id=ident,
                tensors=[tensor_pb2.TensorSpec(name="nope", shape=[4], dtype="float32")],
            ).SerializeToString(),
            ones[:16],
        ),
        "another job": (
            bulk.READ,
            ps_pb2.ReadRequest(
                id=tensor_pb2.Identity(job_id="other", task="chief-0"), names=[shard.name]
            ).SerializeToString(),
            b"",
        ),
        "an unknown method": (7, b"", ones[:64]),
    }
    with _connect(port) as conn:
        for name, (method, message, payload) in refusals.items():
            code, body, data = _call(conn, method, message, payload)
            assert code not in (0, grpc.StatusCode.UNAVAILABLE.value[0]), name
            assert json.loads(body)["details"], name
            assert data == b"", name
        assert _call(conn, bulk.UPDATE, header.SerializeToString(), ones[:-4])[0] == invalid
        # the connection still serves a good call after every refusal
        code, body, data = _call(
            conn,
            bulk.READ,
            ps_pb2.ReadRequest(id=ident, names=[shard.name]).SerializeToString(),
        )
        assert code == 0
        assert tensor_pb2.FrameHeader.FromString(body).step == 0
        assert not np.frombuffer(data, np.float32).any()  # nothing of the refusals was applied

    # a message longer than any header may be, or no hello: the connection is closed
    with _connect(port) as conn:
        conn.sendall(PREFIX.pack(bulk.READ, bulk.MAX_MESSAGE_BYTES + 1, 0))
        assert _closed(conn)
    # a claim beyond what this ps's one shard could ever need, message or tensor bytes: closed
    # at once, before a byte of it is read
    bounds = bulk.Bounds.of([streams.Spec(shard.name, tuple(shard.shape), np.dtype(np.float32))])
    for method, size, nbytes in (
        (bulk.READ, bounds.message_bytes + 1, 0),
        (bulk.UPDATE, 10, bounds.tensor_bytes + 1),
        (bulk.UPDATE, 10, 1 << 62),
    ):
        with _connect(port) as conn:
            conn.settimeout(bulk.FRAME_SECONDS / 2)  # sooner than any timeout of the ps's
            conn.sendall(PREFIX.pack(method, size, nbytes) + b"\0" * 10)
            assert _closed(conn), (method, size, nbytes)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert _closed(conn)
    # a push cut off in the middle of its bytes (the client died) applies nothing
    with _connect(port) as conn:
        message = header.SerializeToString()
        conn.sendall(PREFIX.pack(bulk.UPDATE, len(message), len(ones)) + message + ones[:1000])
    assert client.status(0).step == 0
    _, values = client.read()
    assert not values[shard.variable.name].any()
    client.close()


def test_a_client_without_the_bulk_path_and_one_with_it_see_the_same_values(
    one_ps: harness.LocalPs,
) -> None:
    rng = np.random.default_rng(1)
    tree = {"a": rng.standard_normal((700, 600)).astype(np.float32), "b": np.ones(3, np.float32)}
    client = _client(one_ps, tree, epoch=2)
    grpc_only = PsClient(
        addresses=one_ps.addresses,
        placement=client.placement,
        job_id=JOB_ID,
        task="worker-0",
        use_bulk=False,
    )
    grpc_only.epoch = client.epoch
    before = client.status(0).counters.get("bulk_calls", 0)
    _, named = placement.named_leaves(tree)
    grads = {n: rng.standard_normal(np.shape(v)).astype(np.float32) for n, v in named.items()}
    grpc_only.update(grads, step=0)
    assert client.status(0).counters.get("bulk_calls", 0) == before
    client.update(grads, step=1)
    assert client.status(0).counters.get("bulk_calls", 0) == before + 1
    _, over_bulk = client.read()
    _, over_grpc = grpc_only.read()
    for name, value in named.items():
        expected = np.asarray(value) - 2 * grads[name]
        assert np.array_equal(over_bulk[name], over_grpc[name]), name
        assert np.allclose(over_bulk[name], expected), name
    grpc_only.close()
    client.close()


def test_a_nan_gradient_on_the_bulk_path_is_invalid_argument_and_changes_nothing(
    one_ps: harness.LocalPs,
) -> None:
    tree = {"a": np.zeros(1 << 16, np.float32), "b": np.zeros(1 << 16, np.float32)}
    client = _client(one_ps, tree, epoch=3)
    port = client.status(0).bulk_port
    specs = [
        tensor_pb2.TensorSpec(name=s.name, shape=list(s.shape), dtype="float32")
        for s in client.placement.shards
    ]
    header = tensor_pb2.FrameHeader(id=client.identity(0), step=0, tensors=specs)
    header.id.task = "worker-3"
    ones = np.ones(1 << 16, np.float32)
    with_nan = ones.copy()
    with_nan[-1] = np.nan  # the last byte of the last tensor: the first one is in before it
    with _connect(port) as conn:
        code, body, data = _call(
            conn, bulk.UPDATE, header.SerializeToString(), ones.tobytes() + with_nan.tobytes()
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        error = json.loads(body)
        assert error["reason"] == "nonfinite_gradient"
        for part in (specs[-1].name, "step 0", "worker-3", "not finite"):
            assert part in error["details"], part
        assert data == b""
        # the connection serves the next call, and nothing of the refused one was applied
        code, body, data = _call(
            conn,
            bulk.READ,
            ps_pb2.ReadRequest(
                id=client.identity(0), names=[s.name for s in specs]
            ).SerializeToString(),
        )
        assert code == 0
        assert tensor_pb2.FrameHeader.FromString(body).step == 0
        assert not np.frombuffer(data, np.float32).any()
    assert client.status(0).counters.get("refused_nonfinite_gradient") == 1
    client.close()


def _replace(ps: harness.LocalPs, log: Path) -> None:
    """Kills ps-0 and starts another ps process at its address (as a replaced pod would be)."""
    ps.processes[0].kill()
    ps.processes[0].wait()
    spec = {"ps": ps.addresses, "worker": ["127.0.0.1:1"]}
    tf_config = cluster.build_tf_config(cluster=spec, task_type="ps", task_index=0)
    ps.processes[0] = subprocess.Popen(
        [sys.executable, "-m", "jaxps_runtime"],
        env=harness.runtime_env({"TF_CONFIG": tf_config, "JAXPS_JOB_UID": JOB_ID}),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    harness.wait_serving(ps.addresses[0], timeout=60, process=ps.processes[0])


def test_a_replaced_ps_is_unavailable_under_a_bulk_call_then_found_at_its_new_port(
    tmp_path: Path,
) -> None:
    ps = harness.LocalPs.start(1, job_id=JOB_ID, log_dir=tmp_path)
    tree = {"w": np.zeros(1 << 20, np.float32)}
    try:
        chief = _client(ps, tree, epoch=1)
        worker = PsClient(
            addresses=ps.addresses, placement=chief.placement, job_id=JOB_ID, task="worker-0"
        )
        worker.wait_ready(timeout=30)
        worker.read()
        old_port = worker.status(0).bulk_port
        ps.processes[0].kill()
        ps.processes[0].wait()
        with pytest.raises(PsClientError) as caught:
            worker.read()  # the bulk connection breaks: UNAVAILABLE, retried, still down
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        _replace(ps, tmp_path / "ps-0-again.log")
        chief.close()
        chief = _client(ps, {"w": np.ones(1 << 20, np.float32)}, epoch=2)
        worker.wait_ready(timeout=30)  # learns the new incarnation, and its bulk port
        new_port = worker.status(0).bulk_port
        assert new_port
        assert new_port != old_port
        step, values = worker.read()
        assert step == 0
        assert values["['w']"].all()
        assert chief.status(0).counters.get("bulk_calls", 0) == 1
        worker.close()
        chief.close()
    finally:
        ps.stop()


def test_jaxps_bulk_off_keeps_a_ps_and_its_clients_on_grpc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JAXPS_BULK", "off")  # the ps processes inherit it
    ps = harness.LocalPs.start(1, job_id=JOB_ID, log_dir=tmp_path)
    try:
        client = _client(ps, {"w": np.ones(1000, np.float32)}, epoch=1)
        assert client.status(0).bulk_port == 0
        _, values = client.read()
        assert values["['w']"].all()
        assert (client.bulk_calls, client.data_calls) == (0, 1)
        client.close()
    finally:
        ps.stop()
    assert "its bulk path off (JAXPS_BULK)" in (tmp_path / "ps-0.log").read_text()
