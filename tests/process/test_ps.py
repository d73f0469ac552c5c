"""The parameter server, in real processes, over real gRPC on 127.0.0.1."""

from __future__ import annotations

import itertools
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxps.v1 import parameter_server_pb2, parameter_server_pb2_grpc, tensor_pb2
from jaxps_runtime.client import placement
from jaxps_runtime.client.psclient import PsClient, PsClientError, PsRestartedError
from jaxps_runtime.config import catalog, cluster
from jaxps_runtime.config import training as config
from jaxps_runtime.wire import codec, rpc, streams
from jaxps_runtime.wire.terms import Mode
from tests.process import harness

JOB_ID = "test-job"

# one pytest-xdist worker runs the whole module: its module-scoped processes start once
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("test_ps")]
SGD_1 = config.OptimizerConfig("sgd", {"learning_rate": 1.0})
_epochs = itertools.count(1)


def _client(
    ps: harness.LocalPs,
    tree: Any,
    *,
    task: str = "chief-0",
    job_id: str = JOB_ID,
    min_shard_bytes: int = catalog.DEFAULT_MIN_SHARD_BYTES,
) -> PsClient:
    layout = placement.plan(
        placement.variables_of(tree), num_ps=len(ps.addresses), min_shard_bytes=min_shard_bytes
    )
    return PsClient(addresses=ps.addresses, placement=layout, job_id=job_id, task=task)


def _init(
    ps: harness.LocalPs, tree: Any, optimizer: config.OptimizerConfig = SGD_1, **kwargs: Any
) -> tuple[PsClient, dict[str, np.ndarray]]:
    client = _client(ps, tree, **kwargs)
    _, named = placement.named_leaves(tree)
    client.init(named, optimizer=optimizer, epoch=next(_epochs))
    return client, named


def _worker(chief: PsClient, task: str) -> PsClient:
    client = PsClient(
        addresses=chief.addresses, placement=chief.placement, job_id=JOB_ID, task=task
    )
    client.epoch = chief.epoch
    return client


def _model(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "dense": {
            "kernel": rng.standard_normal((512, 300)).astype(np.float32),
            "bias": rng.standard_normal(300).astype(np.float32),
        },
        "out": {"kernel": rng.standard_normal((300, 10)).astype(np.float32)},
        "scale": np.float32(2.5),
    }


def test_health_service_reports_serving(two_ps: harness.LocalPs) -> None:
    for address in two_ps.addresses:
        with rpc.channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "jaxps.v1.ParameterServer"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_push_then_pull_is_exact_with_sgd_learning_rate_one(two_ps: harness.LocalPs) -> None:
    rng = np.random.default_rng(0)
    client, params = _init(two_ps, _model(rng), min_shard_bytes=64 << 10)
    assert {s.ps for s in client.placement.shards} == {0, 1}
    step, pulled = client.read()
    assert step == 0
    for name, value in params.items():
        assert np.array_equal(pulled[name], value)
    grads = {n: rng.standard_normal(np.shape(v)).astype(np.float32) for n, v in params.items()}
    replies = client.update(grads, step=0)[2]
    assert [r.accepted for r in replies] == [True, True]
    step, pulled = client.read()
    assert step == 1
    for name, value in params.items():
        expected = np.asarray(value, np.float32) - grads[name]
        assert pulled[name].tobytes() == expected.tobytes(), name
    client.close()


def test_concurrent_pushes_from_several_clients_are_all_applied(two_ps: harness.LocalPs) -> None:
    # Small integers are exact in float32 whatever the order of the additions.
    tree = {"w": np.zeros((256, 512), np.float32), "b": np.zeros(64, np.float32)}
    chief, _ = _init(two_ps, tree, min_shard_bytes=64 << 10)
    workers, pushes_each = 4, 5
    clients = [_worker(chief, f"worker-{i}") for i in range(workers)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for k in range(pushes_each):
                grads = {
                    n: np.full(np.shape(v), -(i + 1) * (k + 1), np.float32)
                    for n, v in placement.named_leaves(tree)[1].items()
                }
                assert all(r.accepted for r in clients[i].update(grads, step=k)[2])
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    step, pulled = chief.read()
    total = sum((i + 1) * (k + 1) for i in range(workers) for k in range(pushes_each))
    assert step == workers * pushes_each
    for value in pulled.values():
        assert np.all(value == total)
    for c in [*clients, chief]:
        c.close()


def test_a_64_mib_pytree_round_trips(two_ps: harness.LocalPs) -> None:
    rng = np.random.default_rng(1)
    tree = {f"layer{i}": rng.standard_normal((1024, 2048)).astype(np.float32) for i in range(8)}
    assert sum(v.nbytes for v in tree.values()) == 64 << 20
    client, params = _init(two_ps, tree)
    _, pulled = client.read()
    for name, value in params.items():
        assert np.array_equal(pulled[name], value)
    grads = {n: np.ones_like(v) for n, v in params.items()}
    client.update(grads, step=0)
    _, pulled = client.read()
    for name, value in params.items():
        assert np.array_equal(pulled[name], value - 1)
    client.close()


def test_sparse_row_pull_and_push_touch_only_those_rows(two_ps: harness.LocalPs) -> None:
    rows, dim = 50_000, 16
    table = np.arange(rows * dim, dtype=np.float32).reshape(rows, dim)
    client, _ = _init(two_ps, {"embedding": table, "bias": np.zeros(4, np.float32)})
    shards = client.placement.shards_of("['embedding']")
    assert len(shards) == 2  # 3.2 MB > 256 KiB: split over both ps
    ids = np.array([3, 49_999, 3, 25_001, 7, 3])  # both shards, with duplicates
    got = client.read(variables=(), rows={"['embedding']": ids})[1]["['embedding']"]
    assert np.array_equal(got, table[ids])
    grad_rows = np.ones((ids.size, dim), np.float32)
    client.update({}, variables=(), rows={"['embedding']": (ids, grad_rows)}, step=0)
    _, pulled = client.read()
    expected = table.copy()
    np.subtract.at(expected, ids, 1.0)  # duplicate ids are summed: row 3 moves by 3
    assert np.array_equal(pulled["['embedding']"], expected)
    untouched = np.setdiff1d(np.arange(rows), ids)
    assert np.array_equal(pulled["['embedding']"][untouched], table[untouched])
    client.close()


def test_sparse_updates_leave_other_rows_optimizer_state_alone(two_ps: harness.LocalPs) -> None:
    table = np.zeros((1000, 4), np.float32)
    client, _ = _init(
        two_ps,
        {"e": table},
        config.OptimizerConfig(
            "adagrad", {"learning_rate": 1.0, "initial_accumulator_value": 0.0, "eps": 0.0}
        ),
    )
    ids = np.array([1, 2])
    client.update({}, variables=(), rows={"['e']": (ids, np.ones((2, 4), np.float32))}, step=0)
    client.update({}, variables=(), rows={"['e']": (np.array([2]), np.ones((1, 4)))}, step=1)
    _, pulled = client.read()
    # Adagrad: row 1 saw g=1 once (-1); row 2 saw it twice (-1 - 1/sqrt(2)); others stay 0.
    assert np.allclose(pulled["['e']"][1], -1.0)
    assert np.allclose(pulled["['e']"][2], -1.0 - 1 / np.sqrt(2), atol=1e-6)
    assert not pulled["['e']"][[0, *range(3, 1000)]].any()
    client.close()


def test_a_client_of_another_job_is_refused(two_ps: harness.LocalPs) -> None:
    tree = {"w": np.ones(8, np.float32)}
    chief, _ = _init(two_ps, tree)
    intruder = _client(two_ps, tree, job_id="someone-else", task="worker-9")
    intruder.epoch = chief.epoch
    with pytest.raises(PsClientError) as caught:
        intruder.update({"['w']": np.ones(8, np.float32)}, step=0)
    assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "someone-else" in caught.value.details
    assert JOB_ID in caught.value.details
    with pytest.raises(PsClientError):
        intruder.read()
    _, pulled = chief.read()
    assert np.array_equal(pulled["['w']"], np.ones(8, np.float32))  # nothing applied
    intruder.close()
    chief.close()


def test_a_retried_push_is_applied_once(two_ps: harness.LocalPs) -> None:
    chief, _ = _init(two_ps, {"w": np.zeros(1000, np.float32)})
    grads = {"['w']": np.ones(1000, np.float32)}
    first = chief.update(grads, step=0, push_id="push-42")[2]
    again = chief.update(grads, step=0, push_id="push-42")[2]
    assert [r.step for r in first] == [1, 1]
    assert [r.step for r in again] == [1, 1]
    assert all("duplicate" in r.reason for r in again)
    _, pulled = chief.read()
    assert np.all(pulled["['w']"] == -1)
    chief.close()


def test_pull_waits_for_a_minimum_step(two_ps: harness.LocalPs) -> None:
    chief, _ = _init(two_ps, {"w": np.zeros(10, np.float32)})
    result: dict[str, Any] = {}
    waiter = _worker(chief, "worker-1")
    thread = threading.Thread(
        target=lambda: result.update(zip(("step", "v"), waiter.read(min_step=2), strict=False))
    )
    thread.start()
    chief.update({"['w']": np.ones(10, np.float32)}, step=0)
    assert thread.is_alive() or result.get("step", 0) >= 2
    chief.update({"['w']": np.ones(10, np.float32)}, step=1)
    thread.join(timeout=60)
    assert result["step"] == 2
    assert np.all(result["v"]["['w']"] == -2)
    waiter.close()
    chief.close()


def _bulk_calls(client: PsClient) -> float:
    """The calls the ps tasks served on their bulk path, so far."""
    return sum(r.counters.get("bulk_calls", 0) for r in client.statuses())


@pytest.mark.parametrize("framing", ["packed", "streamed", "bulk"])
def test_an_update_can_bring_back_the_new_values(two_ps: harness.LocalPs, framing: str) -> None:
    tree = {"w": np.arange(600, dtype=np.float32), "b": np.zeros(3, np.float32)}
    chief, params = _init(two_ps, tree, min_shard_bytes=8)
    assert {s.ps for s in chief.placement.shards} == {0, 1}
    epoch = chief.epoch
    chief.close()
    chief = PsClient(
        addresses=two_ps.addresses,
        placement=chief.placement,
        job_id=JOB_ID,
        task="chief-0",
        # streamed: every call's bytes exceed one 64-byte chunk, so grpc frames them by 64
        chunk_bytes=64 if framing == "streamed" else streams.CHUNK_BYTES,
        use_bulk=framing == "bulk",
    )
    chief.epoch = epoch
    bulk_before = _bulk_calls(chief)
    grads = {n: np.full(np.shape(v), 2, np.float32) for n, v in params.items()}
    into = {n: np.full(np.shape(v), np.nan, np.float32) for n, v in params.items()}
    step, pulled, replies = chief.update(grads, step=0, then_read=True, into=into)
    assert step == 1
    assert [r.accepted for r in replies] == [True, True]
    for name, value in params.items():
        assert pulled[name] is into[name]  # written in place
        assert np.array_equal(pulled[name], np.asarray(value) - 2), name
    again = chief.update(grads, step=0, push_id="twice", then_read=True)[0]
    assert chief.update(grads, step=0, push_id="twice", then_read=True)[0] == again == 2
    step, values = chief.read()
    assert step == 2
    assert np.array_equal(values["['w']"], np.arange(600, dtype=np.float32) - 4)
    bulk_calls = _bulk_calls(chief) - bulk_before
    assert bulk_calls == (8 if framing == "bulk" else 0)  # 4 calls to each ps
    chief.close()


def test_one_read_and_one_update_carry_dense_values_and_embedding_rows(
    two_ps: harness.LocalPs,
) -> None:
    rows, dim = 50_000, 16
    table = np.arange(rows * dim, dtype=np.float32).reshape(rows, dim)
    client, _ = _init(two_ps, {"embedding": table, "bias": np.arange(4, dtype=np.float32)})
    assert len(client.placement.shards_of("['embedding']")) == 2
    bias, emb = ["['bias']"], "['embedding']"
    ids = np.array([3, 49_999, 3, 25_001, 7, 3])  # both shards, with duplicates
    step, got = client.read(variables=bias, rows={emb: ids})
    assert step == 0
    assert np.array_equal(got[emb], table[ids])
    assert np.array_equal(got["['bias']"], np.arange(4, dtype=np.float32))
    grad = {"['bias']": np.ones(4, np.float32)}
    sparse = {emb: (ids, np.ones((ids.size, dim), np.float32))}
    for _ in range(2):  # a retry with the same push_id applies the rows and the step once
        step, values, replies = client.update(
            grad, step=0, variables=bias, rows=sparse, push_id="p1"
        )
        assert (step, values) == (1, {})
        assert all(r.accepted for r in replies)
    _, pulled = client.read()
    expected = table.copy()
    np.subtract.at(expected, ids, 1.0)  # duplicate ids are summed: row 3 moves by 3
    assert np.array_equal(pulled[emb], expected)
    assert np.array_equal(pulled["['bias']"], np.arange(4, dtype=np.float32) - 1)
    client.close()


def test_an_update_with_rows_out_of_range_changes_nothing(two_ps: harness.LocalPs) -> None:
    table = np.zeros((1000, 4), np.float32)
    client, _ = _init(two_ps, {"e": table, "w": np.zeros(4, np.float32)}, min_shard_bytes=8)
    shard = client.placement.shards_of("['e']")[0]
    dense = [s for s in client.placement.shards_on(shard.ps) if s.variable.name == "['w']"]
    bad_rows = np.array([0, shard.stop - shard.start], "<i8").tobytes()
    header = tensor_pb2.FrameHeader(
        id=client.identity(shard.ps),
        push_id="bad",
        tensors=[
            *(tensor_pb2.TensorSpec(name=s.name, shape=s.shape, dtype="float32") for s in dense),
            tensor_pb2.TensorSpec(name=shard.name, shape=[2, 4], dtype="float32", rows=bad_rows),
        ],
    )
    data = b"".join(np.ones(s.shape, np.float32).tobytes() for s in dense)
    request = codec.encode(
        tensor_pb2.Frame(header=header), data + np.ones((2, 4)).astype(np.float32).tobytes()
    )
    with rpc.channel(two_ps.addresses[shard.ps]) as channel, pytest.raises(grpc.RpcError) as caught:
        rpc.PARAMETER_SERVER.callables(channel)["Update.packed"](request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Update.tensors[" in (caught.value.details() or "")
    step, pulled = client.read()
    assert step == 0
    assert not pulled["['e']"].any()
    assert not pulled["['w']"].any()
    client.close()


def test_an_update_in_sync_mode_replies_once_the_step_is_complete(
    two_ps: harness.LocalPs,
) -> None:
    tree = {"w": np.zeros(4, np.float32)}
    chief = _mode_init(two_ps, tree, Mode(kind=parameter_server_pb2.SYNC), ["w-0", "w-1"])
    workers = [_worker(chief, f"w-{i}") for i in range(2)]
    got: dict[str, Any] = {}

    def update(i: int, value: float) -> tuple[int, dict[str, np.ndarray], Any]:
        grad = {"['w']": np.full(4, value, np.float32)}
        return workers[i].update(grad, step=0, then_read=True, min_step=1)

    first = threading.Thread(
        target=lambda: got.update(zip(("step", "values", "replies"), update(0, 1), strict=True))
    )
    first.start()
    first.join(timeout=1.0)
    assert first.is_alive()  # one gradient of two: the step is not complete yet
    step, values, _ = update(1, 3)
    first.join(timeout=60)
    assert step == got["step"] == 1
    for pulled in (values, got["values"]):
        assert np.array_equal(pulled["['w']"], np.full(4, -2, np.float32))  # the mean: 2
    for c in [*workers, chief]:
        c.close()


def test_malformed_packed_updates_are_refused_and_change_nothing(two_ps: harness.LocalPs) -> None:
    chief, _ = _init(two_ps, {"w": np.zeros(4, np.float32)})
    shard = chief.placement.shards_of("['w']")[0]
    spec = tensor_pb2.TensorSpec(name=shard.name, shape=[4], dtype="float32")
    header = tensor_pb2.FrameHeader(id=chief.identity(shard.ps), tensors=[spec])
    ok = np.ones(4, np.float32).tobytes()
    cases = {
        "no header": codec.encode(tensor_pb2.Frame(), ok),
        "too few bytes": codec.encode(tensor_pb2.Frame(header=header), ok[:8]),
        "too many bytes": codec.encode(tensor_pb2.Frame(header=header), ok + ok),
        "garbage": b"\xff\xff\xff",
    }
    with rpc.channel(two_ps.addresses[shard.ps]) as channel:
        update = rpc.PARAMETER_SERVER.callables(channel)["Update.packed"]
        for name, request in cases.items():
            with pytest.raises(grpc.RpcError) as caught:
                update(request, timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert caught.value.details(), name
    _, pulled = chief.read()
    assert not pulled["['w']"].any()
    chief.close()


def _frames_stub_call(address: str, frames: list[bytes]) -> Any:
    with rpc.channel(address) as channel:
        update = rpc.PARAMETER_SERVER.callables(channel)["Update"]
        return list(update(iter(frames), timeout=30))


def test_malformed_streamed_updates_are_refused_with_invalid_argument(
    two_ps: harness.LocalPs,
) -> None:
    chief, _ = _init(two_ps, {"w": np.zeros(4, np.float32)})
    shard = chief.placement.shards_of("['w']")[0]
    address = two_ps.addresses[shard.ps]
    spec = tensor_pb2.TensorSpec(name=shard.name, shape=[4], dtype="float32")
    header = tensor_pb2.FrameHeader(id=chief.identity(shard.ps), tensors=[spec])
    ok = np.ones(4, np.float32).tobytes()
    cases = {
        "no header": [codec.encode(tensor_pb2.Frame(offset=0), ok)],
        "unknown shard": [
            codec.encode(
                tensor_pb2.Frame(
                    header=tensor_pb2.FrameHeader(
                        id=header.id,
                        tensors=[tensor_pb2.TensorSpec(name="nope", shape=[4], dtype="float32")],
                    )
                ),
                ok,
            )
        ],
        "wrong shape": [
            codec.encode(
                tensor_pb2.Frame(
                    header=tensor_pb2.FrameHeader(
                        id=header.id,
                        tensors=[
                            tensor_pb2.TensorSpec(name=shard.name, shape=[5], dtype="float32")
                        ],
                    )
                ),
                ok,
            )
        ],
        "chunk past the end": [codec.encode(tensor_pb2.Frame(header=header, offset=0), ok + ok)],
        "out of order": [codec.encode(tensor_pb2.Frame(header=header, offset=8), ok[:8])],
        "truncated": [codec.encode(tensor_pb2.Frame(header=header), ok[:8])],
        "garbage": [b"\xff\xff\xff"],
    }
    for name, frames in cases.items():
        with pytest.raises(grpc.RpcError) as caught:
            _frames_stub_call(address, frames)
        assert caught.value.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
        ), name
        assert caught.value.details(), name
    _, pulled = chief.read()
    assert not pulled["['w']"].any()  # nothing of the bad pushes was applied
    chief.close()


def test_uninitialised_ps_refuses_pushes_and_the_generated_stub_interoperates() -> None:
    ps = harness.LocalPs.start(1, job_id=JOB_ID)
    try:
        with rpc.channel(ps.addresses[0]) as channel:
            stub = parameter_server_pb2_grpc.ParameterServerStub(channel)  # type: ignore[no-untyped-call]
            status = stub.Status(parameter_server_pb2.StatusRequest(), timeout=10)
            assert status.state == parameter_server_pb2.UNINITIALIZED
            assert status.id.job_id == JOB_ID
            assert status.id.ps_incarnation
        client = _client(ps, {"w": np.zeros(4, np.float32)})
        with pytest.raises(PsClientError) as caught:
            client.update({"['w']": np.zeros(4, np.float32)}, step=0)
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "UNINITIALIZED" in caught.value.details
        client.shutdown(reason="test over")
        assert ps.wait_exit(timeout=30) == [0]
        client.close()
    finally:
        ps.stop()


def test_sigterm_stops_a_ps_with_exit_code_143_it_did_not_finish() -> None:
    ps = harness.LocalPs.start(1, job_id=JOB_ID)
    assert ps.stop(timeout=30) == [143]


def test_bad_optimizer_is_refused_naming_the_field(two_ps: harness.LocalPs) -> None:
    client = _client(two_ps, {"w": np.zeros(4, np.float32)})
    with pytest.raises(PsClientError) as caught:
        client.init(
            {"['w']": np.zeros(4, np.float32)},
            optimizer=config.OptimizerConfig("sgd", {"learning_rat": 0.1}),
            epoch=99,
        )
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Init.optimizer.kwargs.learning_rat" in caught.value.details
    client.close()


def test_a_client_that_saw_another_incarnation_is_told_the_ps_restarted(
    two_ps: harness.LocalPs,
) -> None:
    chief, _ = _init(two_ps, {"w": np.zeros(4, np.float32)})
    stale = _worker(chief, "worker-1")
    stale.incarnations = [i + 1 for i in chief.incarnations]  # as if each ps had restarted
    with pytest.raises(PsRestartedError) as caught:
        stale.update({"['w']": np.ones(4, np.float32)}, step=0)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "restarted" in caught.value.details
    _, pulled = chief.read()
    assert not pulled["['w']"].any()
    stale.close()
    chief.close()


def _mode_init(ps: harness.LocalPs, tree: Any, mode: Mode, workers: list[str]) -> PsClient:
    client = _client(ps, tree)
    _, named = placement.named_leaves(tree)
    client.init(named, optimizer=SGD_1, epoch=next(_epochs), mode=mode, workers=workers)
    return client


def test_sync_mode_averages_one_gradient_per_live_worker(two_ps: harness.LocalPs) -> None:
    tree = {"w": np.zeros(8, np.float32)}
    chief = _mode_init(two_ps, tree, Mode(kind=parameter_server_pb2.SYNC), ["w-0", "w-1"])
    a, b = _worker(chief, "w-0"), _worker(chief, "w-1")
    first = a.update({"['w']": np.full(8, 2.0, np.float32)}, step=0)[2]
    assert [r.step for r in first] == [0, 0]  # waiting for w-1
    assert chief.status(0).awaiting == 1
    again = a.update({"['w']": np.full(8, 100.0, np.float32)}, step=0)[2]
    assert all("duplicate" in r.reason for r in again)  # one gradient per worker and step
    done = b.update({"['w']": np.full(8, 4.0, np.float32)}, step=0)[2]
    assert [r.step for r in done] == [1, 1]
    step, pulled = chief.read(min_step=1)
    assert step == 1
    assert np.all(pulled["['w']"] == -3.0)  # mean of 2 and 4, learning rate 1
    stale = b.update({"['w']": np.ones(8, np.float32)}, step=0)[2]
    assert not any(r.accepted for r in stale)
    assert all("stale" in r.reason for r in stale)
    for c in (a, b, chief):
        c.close()


def test_sync_mode_goes_on_when_the_chief_drops_a_dead_worker(two_ps: harness.LocalPs) -> None:
    tree = {"w": np.zeros(8, np.float32)}
    chief = _mode_init(two_ps, tree, Mode(kind=parameter_server_pb2.SYNC), ["w-0", "w-1"])
    alive = _worker(chief, "w-0")
    assert [r.step for r in alive.update({"['w']": np.ones(8, np.float32)}, step=0)[2]] == [0, 0]
    chief.set_workers(["w-0"])  # w-1 missed its heartbeats
    step, pulled = alive.read(min_step=1)
    assert step == 1
    assert np.all(pulled["['w']"] == -1.0)
    alive.close()
    chief.close()


def test_bounded_staleness_holds_back_a_worker_too_far_ahead(two_ps: harness.LocalPs) -> None:
    tree = {"w": np.zeros(8, np.float32)}
    mode = Mode(kind=parameter_server_pb2.BOUNDED_STALENESS, max_staleness=1)
    chief = _mode_init(two_ps, tree, mode, ["w-0", "w-1"])
    fast, slow = _worker(chief, "w-0"), _worker(chief, "w-1")
    grad = {"['w']": np.ones(8, np.float32)}
    fast.update(grad, step=0)
    fast.read()  # 1 ahead of w-1: allowed
    fast.update(grad, step=1)
    result: dict[str, int] = {}
    waiter = threading.Thread(target=lambda: result.update(step=fast.read()[0]))
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive()  # 2 ahead: held back
    slow.update(grad, step=0)
    waiter.join(timeout=60)
    assert result["step"] == 3
    for c in (fast, slow, chief):
        c.close()


# --- non-finite gradients and updates -----------------------------------------------------


def _framed_client(chief: PsClient, framing: str, task: str = "worker-0") -> PsClient:
    """A client of `chief`'s job whose data calls go packed, streamed (64-byte chunks, so a
    shard's update could start before the next shard's bytes are in) or on the bulk path."""
    client = PsClient(
        addresses=chief.addresses,
        placement=chief.placement,
        job_id=JOB_ID,
        task=task,
        chunk_bytes=64 if framing == "streamed" else streams.CHUNK_BYTES,
        use_bulk=framing == "bulk",
    )
    client.epoch = chief.epoch
    return client


def _refused_count(client: PsClient, reason: str) -> float:
    return sum(r.counters.get(f"refused_{reason}", 0) for r in client.statuses())


@pytest.mark.parametrize("framing", ["packed", "streamed", "bulk"])
def test_a_nan_gradient_is_refused_and_nothing_of_its_update_is_applied(
    two_ps: harness.LocalPs, framing: str
) -> None:
    tree = {"w": np.arange(600, dtype=np.float32), "b": np.zeros(3, np.float32)}
    chief, params = _init(two_ps, tree, min_shard_bytes=8)
    bad_ps = max((0, 1), key=lambda ps: len(chief.placement.shards_on(ps)))
    on_bad_ps = chief.placement.shards_on(bad_ps)
    assert len(on_bad_ps) >= 2  # a finite shard comes before the one with the NaN
    last = on_bad_ps[-1]
    worker = _framed_client(chief, framing)
    before = _refused_count(chief, "nonfinite_gradient")
    grads = {n: np.ones(np.shape(v), np.float32) for n, v in params.items()}
    grads[last.variable.name][last.start if last.variable.shape else ...] = np.nan
    with pytest.raises(PsClientError) as caught:
        worker.update(grads, step=0)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason == "nonfinite_gradient"  # what a worker reads as divergence
    assert caught.value.ps == bad_ps
    for part in (last.name, "step 0", "worker-0", "not finite"):
        assert part in caught.value.details, part
    assert chief.status(bad_ps).step == 0
    _, pulled = chief.read()
    for shard in on_bad_ps:  # the whole update changed nothing on that ps
        rows = slice(shard.start, shard.stop) if shard.variable.shape else ...
        value = pulled[shard.variable.name][rows]
        assert np.array_equal(value, np.asarray(params[shard.variable.name])[rows]), shard.name
    assert _refused_count(chief, "nonfinite_gradient") == before + 1
    # the other ps's answer came on the bulk path (a refusal is not counted as answered)
    assert worker.bulk_calls == (1 if framing == "bulk" else 0)
    worker.close()
    chief.close()


def test_nan_gradient_rows_refuse_the_dense_gradients_pushed_with_them(
    two_ps: harness.LocalPs,
) -> None:
    tree = {
        "big": np.zeros(5000, np.float32),  # greedy by bytes: big, then e and w on the other ps
        "e": np.zeros((1000, 4), np.float32),
        "w": np.zeros(4, np.float32),
    }
    client, _ = _init(two_ps, tree)
    ps = client.placement.shards_of("['e']")[0].ps
    assert client.placement.shards_of("['w']")[0].ps == ps
    rows = np.ones((2, 4), np.float32)
    rows[1, 3] = np.inf
    with pytest.raises(PsClientError) as caught:
        client.update(
            {"['w']": np.ones(4, np.float32)},
            variables=["['w']"],
            rows={"['e']": (np.array([5, 6]), rows)},
            step=0,
        )
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.ps == ps
    assert "gradient rows of" in caught.value.details
    assert "not finite" in caught.value.details
    assert client.status(ps).step == 0
    _, pulled = client.read()
    assert not pulled["['e']"].any()
    assert not pulled["['w']"].any()  # the dense gradient before the rows was not applied
    client.close()


@pytest.mark.parametrize("framing", ["packed", "bulk"])
def test_an_update_that_overflows_is_refused_and_the_parameters_keep_their_values(
    two_ps: harness.LocalPs, framing: str
) -> None:
    rng = np.random.default_rng(3)
    huge = config.OptimizerConfig("sgd", {"learning_rate": 1e30})
    chief, params = _init(two_ps, _model(rng), huge, min_shard_bytes=64 << 10)
    worker = _framed_client(chief, framing)
    before = _refused_count(chief, "nonfinite_update")
    grads = {n: np.full(np.shape(v), 1e10, np.float32) for n, v in params.items()}  # finite
    with pytest.raises(PsClientError) as caught:
        worker.update(grads, step=0)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the update is not finite" in caught.value.details
    assert any(repr(s.name) in caught.value.details for s in chief.placement.shards)
    step, pulled = chief.read()
    assert step == 0
    for name, value in params.items():
        assert np.array_equal(pulled[name], value), name
    assert _refused_count(chief, "nonfinite_update") == before + 2  # one on each ps
    # the same optimizer goes on with gradients it can take
    small = {n: np.zeros(np.shape(v), np.float32) for n, v in params.items()}
    assert worker.update(small, step=0)[0] == 1
    worker.close()
    chief.close()


def test_sync_mode_leaves_a_refused_gradient_out_of_the_step(two_ps: harness.LocalPs) -> None:
    tree = {"v": np.zeros(8, np.float32), "w": np.zeros(8, np.float32)}  # one on each ps
    chief = _mode_init(two_ps, tree, Mode(kind=parameter_server_pb2.SYNC), ["w-0", "w-1"])
    assert {s.ps for s in chief.placement.shards} == {0, 1}
    a, b = _worker(chief, "w-0"), _worker(chief, "w-1")

    def grads(value: float) -> dict[str, np.ndarray]:
        return {"['v']": np.full(8, value, np.float32), "['w']": np.full(8, value, np.float32)}

    with pytest.raises(PsClientError) as caught:
        a.update(grads(np.nan), step=0)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [chief.status(ps).awaiting for ps in (0, 1)] == [2, 2]  # the NaN counted nowhere
    assert [r.step for r in b.update(grads(4.0), step=0)[2]] == [0, 0]
    assert [r.step for r in a.update(grads(2.0), step=0)[2]] == [1, 1]
    step, pulled = chief.read(min_step=1)
    assert step == 1
    for value in pulled.values():
        assert np.all(value == -3.0)  # the mean of the two finite gradients
    for c in (a, b, chief):
        c.close()


def _metric_lines(port: int, name: str) -> dict[str, float]:
    """The samples of one metric on a task's /metrics, by their label text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        line[len(name) : line.rindex(" ")]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


def test_refused_updates_are_counted_by_reason_on_the_ps_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = cluster.free_ports(1)[0]
    monkeypatch.setenv("JAXPS_METRICS_PORT", str(port))
    ps = harness.LocalPs.start(1, job_id=JOB_ID, log_dir=tmp_path)
    name = "jaxps_ps_refused_updates_total"
    gradient = '{reason="nonfinite_gradient",task="ps-0"}'
    update = '{reason="nonfinite_update",task="ps-0"}'

    def counted(want: dict[str, float]) -> bool:
        got = _metric_lines(port, name)
        return all(got.get(k) == v for k, v in want.items())

    try:
        client, _ = _init(ps, {"w": np.zeros(4, np.float32)}, SGD_1)
        _wait_until(lambda: counted({gradient: 0, update: 0}), what="both reasons at 0")
        with pytest.raises(PsClientError):
            client.update({"['w']": np.array([1, np.inf, 1, 1], np.float32)}, step=0)
        _wait_until(lambda: counted({gradient: 1, update: 0}), what="one nonfinite_gradient")
        client.close()
        huge = config.OptimizerConfig("sgd", {"learning_rate": 1e30})
        client, _ = _init(ps, {"w": np.zeros(4, np.float32)}, huge)
        with pytest.raises(PsClientError):
            client.update({"['w']": np.full(4, 1e10, np.float32)}, step=0)
        _wait_until(lambda: counted({gradient: 1, update: 1}), what="one nonfinite_update")
        client.close()
    finally:
        ps.stop()


def _wait_until(condition: Callable[[], bool], *, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
