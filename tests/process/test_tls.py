"""Mutual TLS between real processes: a job trains while strangers and wrong roles are refused.

The job runs with its own CA (`harness.LocalJob.start(tls=True)`); the attacks come from this
test process, each over a real gRPC channel to ps-0 while training goes on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.config import cluster
from jaxps_runtime.wire import bulk, credentials, rpc
from tests.process import harness
from tests.process.waiting import wait_for

pytestmark = pytest.mark.process
JOB = "tls-job"
TRAINING = {
    "model": {"name": "mlp"},
    "mode": "sync",
    "steps": 400,
    "batchSize": 32,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    "logEverySeconds": 1,
}


def refusal(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    code: grpc.StatusCode = caught.value.code()
    return code


def status(channel: grpc.Channel, task: str = "worker-0") -> Any:
    """Status, speaking for `task` (the caller's own, or PERMISSION_DENIED)."""
    calls = rpc.PARAMETER_SERVER.callables(channel)
    request = ps_pb2.StatusRequest(id=tensor_pb2.Identity(job_id=JOB, task=task))
    return calls["Status"](request, timeout=5)


def serving(address: str, creds: credentials.TaskCredentials) -> bool:
    try:
        with rpc.channel(address, creds) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def bulk_read(
    address: str,
    port: int,
    creds: credentials.TaskCredentials,
    ident: tensor_pb2.Identity,
) -> grpc.StatusCode:
    """The status of an empty Read on the bulk path of the ps at `address`, with `creds`."""
    peer = bulk.Peer(address, creds)
    peer.learn(port)
    try:
        peer.call("Read", ps_pb2.ReadRequest(id=ident).SerializeToString(), ()).close()
    except bulk.BulkError as err:
        code: grpc.StatusCode = err.code()
        return code
    finally:
        peer.close()
    return grpc.StatusCode.OK


def probe(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0  # not listening yet: the task is still importing


def start_tls_job(
    jobs: list[harness.LocalJob], tmp_path: Path, training: dict[str, Any], *, tasks: int
) -> tuple[harness.LocalJob, str, credentials.TaskCredentials]:
    """A job of `tasks` ps and `tasks` workers over mutual TLS; once ps-0 serves: the job, ps-0's
    address and the chief's (worker 0's) credentials."""
    job = harness.LocalJob.start(
        training=training, log_dir=tmp_path / "logs", job_id=JOB, ps=tasks, workers=tasks, tls=True
    )
    jobs.append(job)
    ps0 = job.spec["ps"][0]
    chief = credentials.TaskCredentials.load(job.tls_dir("worker-0"))
    wait_for(lambda: serving(ps0, chief), job, timeout=120, what="ps-0 serving over mutual TLS")
    return job, ps0, chief


def impostor() -> credentials.TaskCredentials:
    """A certificate of another job's CA naming this job's chief."""
    return credentials.issue(
        credentials.authority("another-job"),
        credentials.Identity(job=JOB, role="worker", index=0),
        hosts=["127.0.0.1"],
    )


def test_strangers_and_wrong_roles_are_refused_while_the_job_trains_to_the_end(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    job, ps0, chief = start_tls_job(jobs, tmp_path, TRAINING, tasks=2)
    worker = credentials.TaskCredentials.load(job.tls_dir("worker-1"))
    ps1 = credentials.TaskCredentials.load(job.tls_dir("ps-1"))
    with rpc.channel(ps0, chief) as channel:
        assert status(channel).id.job_id == JOB  # the chief's own certificate is let in

    # no certificate: plaintext, and TLS without a client certificate
    with rpc.channel(ps0) as plain:
        assert refusal(lambda: status(plain)) == grpc.StatusCode.UNAVAILABLE
    anonymous = grpc.secure_channel(ps0, grpc.ssl_channel_credentials(root_certificates=chief.ca))
    with anonymous:
        assert refusal(lambda: status(anonymous)) == grpc.StatusCode.UNAVAILABLE
    # a certificate of another job's CA, even one naming this job's chief
    with rpc.channel(ps0, impostor()) as channel:
        assert refusal(lambda: status(channel)) == grpc.StatusCode.UNAVAILABLE
    # this job's certificates, used beyond their role
    with rpc.channel(ps0, worker) as channel:
        calls = rpc.PARAMETER_SERVER.callables(channel)
        ident = tensor_pb2.Identity(job_id=JOB, task="worker-1")
        assert (
            refusal(lambda: calls["Shutdown"](ps_pb2.ShutdownRequest(id=ident), timeout=5))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert (
            refusal(lambda: calls["Init"](ps_pb2.InitRequest(id=ident), timeout=5))
            == grpc.StatusCode.PERMISSION_DENIED
        )
    with rpc.channel(ps0, ps1) as channel:
        assert refusal(lambda: status(channel, "ps-1")) == grpc.StatusCode.PERMISSION_DENIED
    # random bytes to every method, with a worker's certificate: refused, the ps serves on
    with rpc.channel(ps0, worker) as channel:
        for spec in rpc.PARAMETER_SERVER.methods.values():
            junk = os.urandom(257)
            call = getattr(channel, spec.kind)(spec.path)

            def send(call: Any = call, junk: bytes = junk, spec: Any = spec) -> Any:
                reply = call(iter([junk]) if spec.client_streaming else junk, timeout=5)
                return list(reply) if spec.server_streaming else reply

            assert refusal(send) != grpc.StatusCode.OK
    assert serving(ps0, chief)
    # the kubelet's probes need no certificate: plain HTTP on each task's metrics port
    for task in ("ps-0", "worker-1"):
        port = job.metrics_ports[task]
        for path in ("/healthz", "/readyz"):

            def answers(port: int = port, path: str = path) -> bool:
                return probe(port, path) == 200

            wait_for(answers, job, timeout=120, what=f"{task} answering {path} with 200")

    codes = job.wait(timeout=300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{job.logs()}"
    summary = job.summary()
    assert summary["step"] == TRAINING["steps"]
    assert summary["eval"]["accuracy"] >= 0.9
    assert "PLAINTEXT" not in job.logs()


def test_the_bulk_path_lets_in_and_refuses_the_certificates_grpc_does(
    jobs: list[harness.LocalJob], tmp_path: Path
) -> None:
    training = {**TRAINING, "steps": 1_000_000}  # trains while the test runs; stopped after
    job, ps0, chief = start_tls_job(jobs, tmp_path, training, tasks=1)
    ps_cert = credentials.TaskCredentials.load(job.tls_dir("ps-0"))
    stranger_cert = impostor()
    with rpc.channel(ps0, chief) as channel:
        wait_for(lambda: status(channel).state == ps_pb2.READY, job, timeout=120, what="READY")
        reply = status(channel)
    assert reply.bulk_port
    ident = tensor_pb2.Identity(
        job_id=JOB,
        task="worker-0",
        ps_incarnation=reply.id.ps_incarnation,
        cluster_epoch=reply.id.cluster_epoch,
    )
    assert bulk_read(ps0, reply.bulk_port, chief, ident) == grpc.StatusCode.OK
    # a ps's own certificate is no caller's; another CA's fails the handshake
    assert bulk_read(ps0, reply.bulk_port, ps_cert, ident) == grpc.StatusCode.PERMISSION_DENIED
    assert bulk_read(ps0, reply.bulk_port, stranger_cert, ident) == grpc.StatusCode.UNAVAILABLE
    stranger = bulk.Peer(ps0, stranger_cert)
    stranger.learn(reply.bulk_port)
    with pytest.raises(bulk.BulkError):
        stranger.call("Read", ps_pb2.ReadRequest(id=ident).SerializeToString(), ())
    stranger.learn(reply.bulk_port)  # a failed handshake: the port is left alone a while
    assert stranger.port == 0
    stranger.close()
    with socket.create_connection(("127.0.0.1", reply.bulk_port), timeout=30) as plain_socket:
        plain_socket.sendall(bulk.HELLO)  # no TLS: the handshake fails, the ps hangs up
        assert plain_socket.recv(64) == b""
    assert serving(ps0, chief)
    assert job.processes["ps-0"].poll() is None


def test_a_task_given_another_tasks_certificate_refuses_to_start(tmp_path: Path) -> None:
    job = harness.LocalJob.start(
        training=TRAINING,
        log_dir=tmp_path / "logs",
        job_id=JOB,
        ps=1,
        workers=1,
        tls=True,
        order=[],
    )
    proc = job.start_task("ps-0", env={"JAXPS_TLS_DIR": str(job.tls_dir("worker-0"))})
    assert proc.wait(timeout=60) == 2
    assert "the certificate is for worker 0 of job tls-job" in job.logs()


def test_a_task_without_credentials_runs_in_plaintext_only_when_told(tmp_path: Path) -> None:
    tf_config = cluster.build_tf_config(
        cluster={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, task_type="ps", task_index=0
    )
    env = harness.runtime_env({"TF_CONFIG": tf_config})
    env.pop("JAXPS_INSECURE")
    env.pop("JAXPS_TLS_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "jaxps_runtime"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "no credentials" in done.stderr
    assert "--insecure" in done.stderr
