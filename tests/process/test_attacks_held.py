"""What one task of the job can hold of a ps's gRPC server, with its own certificate: a real ps
process on 127.0.0.1 over mutual TLS. Calls past a caller's share (`inflight.MAX_CALLS`) are
refused at once while the others are served; a stream stalled in the middle is cancelled after
`inflight.STREAM_STALL_SECONDS`, freeing the step it reserved; a message over the server's
limit is refused before it is read into memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.client import placement
from jaxps_runtime.client.psclient import PsClient
from jaxps_runtime.config import training as config
from jaxps_runtime.wire import codec, credentials, inflight, rpc
from jaxps_runtime.wire.terms import Mode
from tests.process import harness

# one pytest-xdist worker runs the whole module: its module-scoped processes start once
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("test_attacks_held")]
JOB_ID = "held-job"
DENSE = "['k']/0"
TREE = {"k": np.zeros((8, 4), np.float32)}
_epochs = iter(range(1, 1_000))


class Ps:
    """The ps, its log and the job's credentials."""

    def __init__(self, ps: harness.LocalPs, tls: Path, log: Path) -> None:
        self.ps, self.address, self.log = ps, ps.addresses[0], log
        self.creds = {
            name: credentials.TaskCredentials.load(tls / name)
            for name in ("worker-0", "worker-1", "evaluator-0")
        }

    def client(self, task: str) -> PsClient:
        layout = placement.plan(placement.variables_of(TREE), num_ps=1)
        return PsClient(
            addresses=[self.address],
            placement=layout,
            job_id=JOB_ID,
            task=task,
            credentials=self.creds[task],
            use_bulk=False,
        )

    def chief(self, *, last_step: int) -> PsClient:
        """worker-0, the chief, after an Init of a fresh async job."""
        chief = self.client("worker-0")
        chief.init(
            placement.named_leaves(TREE)[1],
            optimizer=config.OptimizerConfig("sgd", {"learning_rate": 1.0}),
            epoch=next(_epochs),
            mode=Mode(kind=ps_pb2.ASYNC, last_step=last_step),
        )
        return chief

    def pid(self) -> int:
        return self.ps.processes[0].pid

    def wait_for(self, condition: Callable[[], bool], *, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{self.tail()}"
            time.sleep(0.05)

    def tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-40:])


@pytest.fixture(scope="module")
def tls_ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ps]:
    logs = tmp_path_factory.mktemp("logs")
    tls = tmp_path_factory.mktemp("tls")
    running = harness.LocalPs.start(1, job_id=JOB_ID, workers=2, log_dir=logs, tls=tls)
    yield Ps(running, tls, logs / "ps-0.log")
    running.stop()


def _held_stream(ps: Ps, task: str, release: threading.Event, *, first: bytes | None) -> Any:
    """An Update stream of `task` that sends `first` (or nothing) and then nothing more until
    `release`: a future of its outcome."""

    def frames() -> Iterator[bytes]:
        if first is not None:
            yield first
        release.wait()

    channel = rpc.channel(ps.address, ps.creds[task])
    call: grpc.StreamStreamMultiCallable = rpc.PARAMETER_SERVER.callables(channel)["Update"]
    future = call(frames())  # a grpc.Future too
    future.add_done_callback(lambda _: channel.close())
    return future


def _code(future: Future[Any]) -> grpc.StatusCode | None:
    error = future.exception()
    return error.code() if isinstance(error, grpc.RpcError) else None


def _push_header(ps: Ps, task: str, step: int) -> tensor_pb2.FrameHeader:
    """The header of an honest push of `task` at `step` (the kernel's 128 bytes)."""
    status = ps.client("worker-0").status(0)
    return tensor_pb2.FrameHeader(
        id=tensor_pb2.Identity(
            job_id=JOB_ID,
            task=task,
            ps_incarnation=status.id.ps_incarnation,
            cluster_epoch=status.id.cluster_epoch,
        ),
        step=step,
        push_id=f"held-{time.monotonic_ns()}",
        tensors=[tensor_pb2.TensorSpec(name=DENSE, shape=[8, 4], dtype="float32")],
    )


def _header_and_a_little(ps: Ps, task: str, step: int) -> bytes:
    """The first frame of an honest push of `task` at `step`: the header and 16 of its 128
    bytes."""
    header = _push_header(ps, task, step)
    return codec.encode(tensor_pb2.Frame(header=header), b"\0" * 16)


def test_a_caller_past_its_share_of_calls_is_refused_and_its_stalled_streams_are_cancelled(
    tls_ps: Ps,
) -> None:
    chief = tls_ps.chief(last_step=1_000)
    release = threading.Event()
    extra = 4
    held = [
        _held_stream(tls_ps, "worker-1", release, first=None)
        for _ in range(inflight.MAX_CALLS + extra)
    ]
    try:
        # the calls past the share are refused at once, naming the limit
        tls_ps.wait_for(
            lambda: sum(f.done() for f in held) >= extra,
            timeout=30,
            what=f"{extra} calls over worker-1's share to be refused",
        )
        refused = [f for f in held if f.done()]
        assert {_code(f) for f in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "inflight.MAX_CALLS" in (refused[0].exception().details() or "")
        # the others are served meanwhile: the chief pushes and reads
        chief.update({"['k']": np.ones((8, 4), np.float32)}, step=0)
        assert chief.read()[0] == 1
        # the stalled ones are cancelled by the ps, and worker-1 is served again
        started = time.monotonic()
        tls_ps.wait_for(
            lambda: all(f.done() for f in held),
            timeout=inflight.STREAM_STALL_SECONDS + 30,
            what="the ps to cancel worker-1's stalled streams",
        )
        assert time.monotonic() - started >= inflight.STREAM_STALL_SECONDS - 5
        assert {_code(f) for f in held if f not in refused} == {grpc.StatusCode.CANCELLED}
        assert tls_ps.client("worker-1").status(0).step == 1
        assert "cancelled a stream of" in tls_ps.log.read_text()
    finally:
        release.set()
        chief.close()


def test_a_push_stalled_in_its_middle_holds_no_step_and_the_job_reaches_its_last(
    tls_ps: Ps,
) -> None:
    chief = tls_ps.chief(last_step=3)
    release = threading.Event()
    stalled = _held_stream(
        tls_ps, "worker-1", release, first=_header_and_a_little(tls_ps, "worker-1", 0)
    )
    try:
        ones = {"['k']": np.ones((8, 4), np.float32)}

        def pushed_to_the_end() -> bool:
            step = chief.read()[0]
            if step < 3:
                chief.update(ones, step=step)
            return chief.read()[0] == 3

        # the stalled push reserved a step in async mode: the last is reached once it is cut
        tls_ps.wait_for(
            pushed_to_the_end,
            timeout=inflight.STREAM_STALL_SECONDS + 30,
            what="the chief's pushes to reach the last step",
        )
        tls_ps.wait_for(stalled.done, timeout=30, what="the stalled push to end")
        assert _code(stalled) == grpc.StatusCode.CANCELLED
        assert np.array_equal(chief.read()[1]["['k']"], -3 * np.ones((8, 4), np.float32))
    finally:
        release.set()
        chief.close()


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("task", ["worker-1", "evaluator-0"])
def test_a_message_over_the_servers_limit_is_refused_before_it_is_read(
    tls_ps: Ps, task: str
) -> None:
    chief = tls_ps.chief(last_step=1_000)
    big = rpc.MAX_RECEIVE_BYTES + (16 << 20)
    header = _push_header(tls_ps, task, 0)
    message = codec.encode(tensor_pb2.Frame(header=header), bytes(big))
    before = _peak_rss_mb(tls_ps.pid())
    with rpc.channel(tls_ps.address, tls_ps.creds[task]) as channel:
        calls = rpc.PARAMETER_SERVER.callables(channel)
        with pytest.raises(grpc.RpcError) as caught:
            calls["Update.packed"](message, timeout=60)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value.details()
    assert _peak_rss_mb(tls_ps.pid()) - before < big / 2**20 / 2  # not read into memory
    chief.update({"['k']": np.ones((8, 4), np.float32)}, step=0)
    assert chief.read()[0] == 1
    chief.close()
