"""Starting ps processes on this machine (tests, benchmarks, the demo).

Processes are started with subprocess, never forked, because grpc and jax must not be forked
once imported (research pitfall 14). `LocalPs.stop` asks politely (SIGTERM), waits, then kills:
nothing started here is left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxps_runtime import cluster, rpc

RUNTIME_ROOT = Path(__file__).resolve().parent.parent


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out now on 127.0.0.1 (all distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def runtime_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(RUNTIME_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(extra or {})
    return env


def wait_serving(
    address: str, *, timeout: float, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Waits for the standard gRPC health service at `address` to report SERVING."""
    deadline = time.monotonic() + timeout
    with rpc.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{address}: process exited with {process.returncode}")
            try:
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0, wait_for_ready=True
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address}: not SERVING after {timeout:.0f} s")


@dataclass
class LocalPs:
    """ps processes of one job on 127.0.0.1."""

    addresses: list[str]
    processes: list[subprocess.Popen[bytes]]

    @classmethod
    def start(
        cls,
        num_ps: int,
        *,
        job_id: str = "test-job",
        workers: int = 1,
        log_dir: Path | None = None,
        timeout: float = 60.0,
    ) -> LocalPs:
        ports = free_ports(num_ps + workers)
        spec = {
            "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]],
        }
        procs = []
        for i in range(num_ps):
            tf_config = cluster.build_tf_config(cluster=spec, task_type="ps", task_index=i)
            out = open(log_dir / f"ps-{i}.log", "wb") if log_dir else subprocess.DEVNULL  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "jaxps_runtime"],
                    env=runtime_env({"TF_CONFIG": tf_config, "JAXPS_JOB_UID": job_id}),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        running = cls(spec["ps"], procs)
        try:
            for address, proc in zip(running.addresses, procs, strict=True):
                wait_serving(address, timeout=timeout, process=proc)
        except BaseException:
            running.stop()
            raise
        return running

    def stop(self, *, timeout: float = 15.0) -> list[int | None]:
        """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit codes."""
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.processes:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return [p.returncode for p in self.processes]

    def wait_exit(self, *, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in self.processes:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes
