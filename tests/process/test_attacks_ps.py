"""Requests a ps refuses for what they mean, not how they are framed (issue 32): a real ps
process on 127.0.0.1 gets each one over gRPC and over the bulk path, answers INVALID_ARGUMENT
naming what was wrong, changes nothing, and serves the next honest request; and a job over
mutual TLS, attacked with a worker's own certificate, trains to the end."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.client import placement
from jaxps_runtime.client.psclient import PsClient, PsClientError
from jaxps_runtime.config import training as config
from jaxps_runtime.wire import bulk, codec, credentials, rpc
from jaxps_runtime.wire.terms import Mode
from tests.process import harness
from tests.process.waiting import wait_for

# one pytest-xdist worker runs the whole module: its module-scoped processes start once
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("test_attacks_ps")]
JOB_ID = "test-job"
SGD_1 = config.OptimizerConfig("sgd", {"learning_rate": 1.0})
LAST_STEP = 100
TABLE, DENSE = "['e']/0", "['k']/0"  # a 64 x 4 embedding table and an 8 x 4 kernel, one shard each
FAR = 2**62
_epochs = itertools.count(1)


@pytest.fixture(scope="module")
def one_ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.LocalPs]:
    running = harness.LocalPs.start(1, job_id=JOB_ID, log_dir=tmp_path_factory.mktemp("logs"))
    yield running
    running.stop()


def _chief(ps: harness.LocalPs) -> PsClient:
    """The chief of a fresh job on `ps`: async up to `LAST_STEP`, the table declared as one."""
    tree = {"e": np.zeros((64, 4), np.float32), "k": np.zeros((8, 4), np.float32)}
    layout = placement.plan(placement.variables_of(tree), num_ps=1)
    client = PsClient(addresses=ps.addresses, placement=layout, job_id=JOB_ID, task="chief-0")
    client.init(
        placement.named_leaves(tree)[1],
        optimizer=SGD_1,
        epoch=next(_epochs),
        mode=Mode(kind=ps_pb2.ASYNC, last_step=LAST_STEP),
        tables={"['e']"},
    )
    assert sorted(s.name for s in layout.shards) == [TABLE, DENSE]
    return client


# --- the two transports, raw ------------------------------------------------------------------


class Transport(NamedTuple):
    """Sends one raw Update (header, tensor bytes) or Read to a ps; raises its grpc.RpcError."""

    update: Callable[[str, int, tensor_pb2.FrameHeader, bytes], None]
    read: Callable[[str, int, ps_pb2.ReadRequest], None]


def _grpc_update(address: str, _: int, header: tensor_pb2.FrameHeader, data: bytes) -> None:
    with rpc.channel(address) as channel:
        call = rpc.PARAMETER_SERVER.callables(channel)["Update.packed"]
        call(codec.encode(tensor_pb2.Frame(header=header), data), timeout=30)


def _grpc_read(address: str, _: int, request: ps_pb2.ReadRequest) -> None:
    with rpc.channel(address) as channel:
        rpc.PARAMETER_SERVER.callables(channel)["Read.packed"](request, timeout=30)


def _bulk_call(
    address: str, port: int, method: str, message: bytes, data: bytes = b"", **kw: Any
) -> None:
    peer = bulk.Peer(address, kw.get("creds"))
    peer.learn(port)
    try:
        peer.call(method, message, [memoryview(data)] if data else [], timeout=30).close()
    finally:
        peer.close()


def _bulk_update(address: str, port: int, header: tensor_pb2.FrameHeader, data: bytes) -> None:
    _bulk_call(address, port, "Update", header.SerializeToString(), data)


def _bulk_read(address: str, port: int, request: ps_pb2.ReadRequest) -> None:
    _bulk_call(address, port, "Read", request.SerializeToString())


TRANSPORTS = {
    "grpc": Transport(_grpc_update, _grpc_read),
    "bulk": Transport(_bulk_update, _bulk_read),
}


def _refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details() or ""


# --- the attacks ----------------------------------------------------------------------------


def _spec(
    name: str, shape: list[int], dtype: str = "float32", rows: list[int] | None = None
) -> Any:
    return tensor_pb2.TensorSpec(
        name=name,
        shape=shape,
        dtype=dtype,
        rows=np.array(rows or [], "<i8").tobytes(),
    )


class Attack(NamedTuple):
    """An Update header's fields beyond its identity, and what its refusal must name."""

    tensors: list[tensor_pb2.TensorSpec]
    names: tuple[str, ...]
    step: int = 0
    then_read: bool = False
    min_step: int = 0
    push_id: str = "attack"
    shard: str = ""  # a batch of data shard `shard` at cursor 1
    extra_bytes: int = 0  # tensor bytes beyond what the header's tensors hold


ATTACKS = {
    "a far-future step": Attack(
        [_spec(DENSE, [8, 4])], ("Update.step", f"step {FAR} is ahead", "at most 0"), step=FAR
    ),
    "a then_read past the last step": Attack(
        [_spec(DENSE, [8, 4])],
        ("Update.min_step", f"min_step {FAR} is past the last step {LAST_STEP}"),
        then_read=True,
        min_step=FAR,
    ),
    "rows of a dense shard": Attack(
        [_spec(DENSE, [2, 4], rows=[0, 1])],
        (DENSE, "a dense variable's, updated whole", "got 2 rows"),
    ),
    "a whole gradient of an embedding table": Attack(
        [_spec(TABLE, [64, 4])], (TABLE, "updated by rows", "without row ids")
    ),
    "a row id out of range": Attack(
        [_spec(TABLE, [2, 4], rows=[0, 64])], ("row 64 is outside", TABLE, "rows are 0..63")
    ),
    "more row ids than allowed": Attack(
        [_spec(TABLE, [65_537, 4], rows=[0] * 65_537)], ("65537 row ids", "at most 65536")
    ),
    "a wrong shape": Attack([_spec(DENSE, [4, 8])], (DENSE, "float32[8, 4]", "float32[4, 8]")),
    "a wrong dtype": Attack([_spec(DENSE, [8, 4], "float64")], (DENSE, "got float64[8, 4]")),
    "an unknown name": Attack([_spec("['nope']/0", [8, 4])], ("holds no shard", "['nope']/0")),
    "a name twice": Attack([_spec(DENSE, [8, 4]), _spec(DENSE, [8, 4])], (DENSE, "appears twice")),
    "more names than the ps holds": Attack(
        [_spec(DENSE, [8, 4]), _spec(TABLE, [1, 4], rows=[0]), _spec("['x']/0", [1])],
        ("Update.tensors: 3 tensors; at most 2",),
    ),
    "a push id of a megabyte": Attack(
        [_spec(DENSE, [8, 4])],
        ("Update.push_id", "1048576 characters; at most 64"),
        push_id="x" * (1 << 20),
    ),
    "a data shard of other digits than ASCII's": Attack(
        [_spec(DENSE, [8, 4])], ("Update.shard", "'1:²' is no data shard"), shard="1:²"
    ),
    "a data shard of 5,000 digits": Attack(
        [_spec(DENSE, [8, 4])],
        ("Update.shard", "is no data shard", "at most 18 ASCII digits"),
        shard="1:" + "1" * 5_000,
    ),
    "a tensor without a name": Attack(
        [_spec("", [8, 4])], ("Update.tensors[0].name: empty", "expected a shard name")
    ),
    "a dtype that means nothing": Attack(
        [_spec(DENSE, [8, 4], "object")], ("Update.tensors[0].dtype: got 'object'", "allowed")
    ),
    "a negative dimension": Attack(
        [_spec(DENSE, [-1, 4])], ("Update.tensors[0].shape: got [-1, 4]", "must be >= 0")
    ),
    "more bytes than the tensors hold": Attack(
        [_spec(DENSE, [8, 4])], ("132", "128"), extra_bytes=4
    ),
}


def _payload(tensors: list[tensor_pb2.TensorSpec]) -> bytes:
    """Ones of every tensor's dtype and shape: finite, so only the header can be wrong (none
    for a tensor that can hold none)."""
    return b"".join(
        np.ones(list(t.shape), t.dtype).tobytes()
        for t in tensors
        if t.dtype != "object" and min(t.shape, default=0) >= 0
    )


def _refused(chief: PsClient) -> float:
    """Updates the ps refused as meaning nothing, so far (its counters outlive an Init)."""
    return chief.status(0).counters.get("refused_invalid_request", 0.0)


def _unchanged(chief: PsClient) -> None:
    step, values = chief.read()
    assert step == 0
    assert not any(v.any() for v in values.values())


@pytest.mark.parametrize("transport", TRANSPORTS, ids=list(TRANSPORTS))
@pytest.mark.parametrize("attack", ATTACKS.values(), ids=list(ATTACKS))
def test_an_update_that_means_nothing_is_invalid_argument_and_changes_nothing(
    one_ps: harness.LocalPs, attack: Attack, transport: str
) -> None:
    chief = _chief(one_ps)
    port = chief.status(0).bulk_port
    header = tensor_pb2.FrameHeader(
        id=chief.identity(0),
        step=attack.step,
        tensors=attack.tensors,
        push_id=attack.push_id,
        then_read=attack.then_read,
        min_step=attack.min_step,
        shard=attack.shard,
        cursor=1 if attack.shard else 0,
        lease=1 if attack.shard else 0,
    )
    header.id.task = "worker-0"
    refused = _refused(chief)
    send = TRANSPORTS[transport].update
    code, details = _refusal(
        lambda: send(
            one_ps.addresses[0], port, header, _payload(attack.tensors) + bytes(attack.extra_bytes)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    for part in (*attack.names, "nothing of this update was applied"):
        assert part in details, (part, details)
    _unchanged(chief)
    assert _refused(chief) == refused + 1
    # the ps serves the next honest push as ever
    ids = np.array([3, 3])
    chief.update(
        {"['k']": np.ones((8, 4), np.float32)},
        variables={"['k']"},
        rows={"['e']": (ids, np.ones((2, 4), np.float32))},
        step=0,
    )
    step, values = chief.read()
    assert step == 1
    assert np.array_equal(values["['k']"], -np.ones((8, 4), np.float32))
    assert np.array_equal(values["['e']"][3], np.full(4, -2, np.float32))
    assert not np.delete(values["['e']"], 3, axis=0).any()
    chief.close()


READS = {
    "a min_step past the last step": (
        ps_pb2.ReadRequest(names=[DENSE], min_step=FAR),
        ("Read.min_step", f"min_step {FAR} is past the last step {LAST_STEP}"),
    ),
    "an unknown name": (ps_pb2.ReadRequest(names=["['nope']/0"]), ("holds no shard",)),
    "a name twice": (ps_pb2.ReadRequest(names=[DENSE, DENSE]), ("Read.names", "appears twice")),
    "more names than the ps holds": (
        ps_pb2.ReadRequest(names=[f"n{i}" for i in range(10_001)]),
        ("10001 names", "holds 2 shards"),
    ),
    "a row selection out of range": (
        ps_pb2.ReadRequest(
            selections=[ps_pb2.RowSelection(name=TABLE, rows=np.array([64], "<i8").tobytes())]
        ),
        ("row 64 is outside", "rows are 0..63"),
    ),
}


@pytest.mark.parametrize("transport", TRANSPORTS, ids=list(TRANSPORTS))
@pytest.mark.parametrize("read", READS.values(), ids=list(READS))
def test_a_read_that_means_nothing_is_refused_at_once(
    one_ps: harness.LocalPs, read: tuple[ps_pb2.ReadRequest, tuple[str, ...]], transport: str
) -> None:
    chief = _chief(one_ps)
    port = chief.status(0).bulk_port
    request, names = ps_pb2.ReadRequest(), read[1]
    request.CopyFrom(read[0])
    request.id.CopyFrom(chief.identity(0))
    request.id.task = "worker-0"
    send = TRANSPORTS[transport].read
    started = time.monotonic()
    code, details = _refusal(lambda: send(one_ps.addresses[0], port, request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert time.monotonic() - started < 5  # not a wait until the call's deadline
    for part in names:
        assert part in details, (part, details)
    _unchanged(chief)
    chief.close()


def test_a_save_for_a_step_past_the_last_one_is_refused_at_once(
    one_ps: harness.LocalPs, tmp_path: Path
) -> None:
    chief = _chief(one_ps)
    started = time.monotonic()
    with pytest.raises(PsClientError) as caught:
        chief.save(step=FAR, directory=str(tmp_path), timeout=30)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details
    assert f"Save.step: step {FAR} is past the last step {LAST_STEP}" in caught.value.details
    assert time.monotonic() - started < 5
    assert not list(tmp_path.iterdir())
    chief.close()


def _names(count: int) -> list[tensor_pb2.TensorSpec]:
    """`count` one-element tensors, the last one repeating the one before it."""
    names = [f"['v{i}']/0" for i in range(count - 1)]
    return [_spec(n, [1]) for n in [*names, names[-1]]]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


@pytest.mark.parametrize("transport", TRANSPORTS, ids=list(TRANSPORTS))
def test_ten_thousand_and_one_names_cost_the_ps_next_to_nothing(
    one_ps: harness.LocalPs, transport: str
) -> None:
    chief = _chief(one_ps)
    port = chief.status(0).bulk_port
    tensors = _names(10_001)
    header = tensor_pb2.FrameHeader(id=chief.identity(0), tensors=tensors)
    data = _payload(tensors)
    send = TRANSPORTS[transport].update
    pid = one_ps.processes[0].pid
    cpu, started = _cpu_seconds(pid), time.monotonic()
    code, details = _refusal(lambda: send(one_ps.addresses[0], port, header, data))
    wall, cpu = time.monotonic() - started, _cpu_seconds(pid) - cpu
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "10001 tensors" in details
    assert cpu < 0.1, f"the ps spent {cpu:.2f} s of CPU on one header of 10,001 names"
    assert wall < 0.5, f"{wall:.2f} s"
    _unchanged(chief)
    chief.close()


# --- a job over mutual TLS, attacked by one of its own workers ------------------------------

TLS_JOB = "attacked-job"
TRAINING = {
    "model": {"name": "mlp"},
    "mode": "sync",
    "steps": 400,
    "batchSize": 32,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    "logEverySeconds": 1,
}


def test_a_worker_with_its_own_certificate_is_refused_every_meaningless_request_and_the_job_trains(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    job = harness.LocalJob.start(
        training=TRAINING, log_dir=tmp_path / "logs", job_id=TLS_JOB, ps=1, workers=2, tls=True
    )
    jobs.append(job)
    ps0 = job.spec["ps"][0]
    worker = credentials.TaskCredentials.load(job.tls_dir("worker-1"))

    def status() -> ps_pb2.StatusReply:
        with rpc.channel(ps0, worker) as channel:
            calls = rpc.PARAMETER_SERVER.callables(channel)
            reply: ps_pb2.StatusReply = calls["Status"](
                ps_pb2.StatusRequest(id=tensor_pb2.Identity(job_id=TLS_JOB, task="worker-1")),
                timeout=5,
            )
            return reply

    def ready() -> bool:
        try:
            return status().state == ps_pb2.READY
        except grpc.RpcError:
            return False

    wait_for(ready, job, timeout=120, what="ps-0 READY over mutual TLS")
    reply = status()
    ident = tensor_pb2.Identity(
        job_id=TLS_JOB,
        task="worker-1",
        ps_incarnation=reply.id.ps_incarnation,
        cluster_epoch=reply.id.cluster_epoch,
    )
    kernel = next(t for t in reply.tensors if len(t.shape) == 2)
    rows, cols = kernel.shape
    good = _spec(kernel.name, [rows, cols])
    attacks = {
        "a far-future step": ([good], FAR),
        "rows out of range": ([_spec(kernel.name, [1, cols], rows=[rows])], 0),
        "a wrong shape": ([_spec(kernel.name, [rows + 1, cols])], 0),
        "a wrong dtype": ([_spec(kernel.name, [rows, cols], "float64")], 0),
        "an unknown name": ([_spec("['nope']/0", [rows, cols])], 0),
        "10,001 names": (_names(10_001), 0),
    }

    def grpc_update(header: tensor_pb2.FrameHeader, data: bytes) -> None:
        with rpc.channel(ps0, worker) as channel:
            call = rpc.PARAMETER_SERVER.callables(channel)["Update.packed"]
            call(codec.encode(tensor_pb2.Frame(header=header), data), timeout=30)

    def bulk_update(header: tensor_pb2.FrameHeader, data: bytes) -> None:
        _bulk_call(ps0, reply.bulk_port, "Update", header.SerializeToString(), data, creds=worker)

    for name, (tensors, step) in attacks.items():
        header = tensor_pb2.FrameHeader(id=ident, step=step, tensors=tensors)
        for send in (grpc_update, bulk_update):
            code, details = _refusal(lambda: send(header, _payload(tensors)))  # noqa: B023
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, send.__name__, details)
    far_read = ps_pb2.ReadRequest(id=ident, names=[kernel.name], min_step=FAR)
    with rpc.channel(ps0, worker) as channel:
        read = rpc.PARAMETER_SERVER.callables(channel)["Read.packed"]
        code, details = _refusal(lambda: read(far_read, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    code, details = _refusal(
        lambda: _bulk_call(ps0, reply.bulk_port, "Read", far_read.SerializeToString(), creds=worker)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details

    codes = job.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    summary = job.summary()
    assert summary["step"] == TRAINING["steps"]
    assert summary["eval"]["accuracy"] >= 0.9
