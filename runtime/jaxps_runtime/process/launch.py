"""Starting ps processes on this machine (tests, benchmarks, the demo).

Processes are started with subprocess, never forked, because grpc and jax must not be forked
once imported (research pitfall 14). `LocalPs.stop` asks politely (SIGTERM), waits, then kills:
nothing started here is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxps_runtime.config import cluster
from jaxps_runtime.process.standby import Standby
from jaxps_runtime.wire import credentials, rpc

RUNTIME_ROOT = Path(__file__).resolve().parents[2]


def runtime_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(RUNTIME_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("JAXPS_INSECURE", "1")  # tasks given credentials (tls=True) use them
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
            time.sleep(0.02)  # NOT_SERVING while it loads: ask again soon, not in a spin


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
        ports = cluster.free_ports(num_ps + workers)
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


@dataclass
class LocalJob:
    """Every task of a training job as processes on 127.0.0.1, with a log file per task."""

    spec: dict[str, list[str]]
    processes: dict[str, subprocess.Popen[bytes]]
    log_dir: Path
    env: dict[str, str]
    metrics_ports: dict[str, int] = field(default_factory=dict)
    authority: credentials.Authority | None = None  # the job's CA when it runs with mutual TLS
    standby: Standby | None = None  # a loaded ps that a restarted ps becomes (`start(standby=)`)

    @classmethod
    def start(
        cls,
        *,
        training: Mapping[str, object],
        log_dir: Path,
        ps: int = 2,
        workers: int = 2,
        chief: bool = False,
        evaluator: bool = False,
        job_id: str = "local-job",
        extra_env: Mapping[str, str] | None = None,
        order: Sequence[str] | None = None,
        task_env: Mapping[str, Mapping[str, str]] | None = None,
        tls: bool = False,
        standby: bool = False,
    ) -> LocalJob:
        """Starts the tasks (only those in `order`, in that order, if given) and returns at once.

        `task_env` adds environment variables to single tasks by name. With `tls`, the job gets
        its own CA and every task its certificate (in `log_dir/tls/<task>`): mutual TLS. With
        `standby`, a ps started again (`start_task`) becomes a process loaded ahead (`Standby`),
        and another is started for the next one.
        """
        counts = {"chief": int(chief), "ps": ps, "worker": workers, "evaluator": int(evaluator)}
        ports = iter(cluster.free_ports(2 * sum(counts.values())))
        spec = {
            role: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for role, n in counts.items() if n
        }
        env = {"JAXPS_JOB_UID": job_id, "JAXPS_TRAINING": json.dumps(training), **(extra_env or {})}
        log_dir.mkdir(parents=True, exist_ok=True)
        job = cls(spec=spec, processes={}, log_dir=log_dir, env=env)
        names = [f"{role}-{i}" for role, addrs in spec.items() for i in range(len(addrs))]
        job.metrics_ports = {name: next(ports) for name in names}
        if tls:
            job.authority = credentials.authority(job_id)
            for name in names:
                role, _, index = name.rpartition("-")
                identity = credentials.Identity(job=job_id, role=role, index=int(index))
                issued = credentials.issue(job.authority, identity, hosts=["127.0.0.1"])
                issued.write(job.tls_dir(name))
        for name in names if order is None else order:
            job.start_task(
                name, metrics_port=job.metrics_ports[name], env=(task_env or {}).get(name)
            )
        if standby and "ps" in spec:
            job.standby = Standby(job.task_env("ps-0"), log=log_dir / "standby.log")
        return job

    def tls_dir(self, name: str) -> Path:
        """Where task `name`'s credentials are (with `tls`)."""
        return self.log_dir / "tls" / name

    def start_task(
        self, name: str, *, metrics_port: int = 0, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Starts (or starts again) one task; its stdout goes to <name>.out, logs to <name>.log.
        A ps becomes the job's standby when it has one that fits (then a new one is started)."""
        full_env = self.task_env(name, metrics_port=metrics_port, env=env)
        out, err = self.log_dir / f"{name}.out", self.log_dir / f"{name}.log"
        proc = None
        if self.standby is not None and name.startswith("ps-"):
            proc = self.standby.take(full_env, stdout=out, stderr=err)
            if proc is not None or not self.standby.alive:  # taken, or dead: another one
                self.standby = Standby(full_env, log=self.log_dir / "standby.log")
        if proc is None:
            with open(out, "ab") as stdout, open(err, "ab") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "jaxps_runtime"],
                    env=full_env,
                    stdout=stdout,
                    stderr=stderr,
                )
        self.processes[name] = proc
        self.metrics_ports[name] = metrics_port
        return proc

    def task_env(
        self, name: str, *, metrics_port: int = 0, env: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The environment task `name` runs with."""
        role, _, index = name.rpartition("-")
        tf_config = cluster.build_tf_config(
            cluster=self.spec, task_type=role, task_index=int(index)
        )
        return runtime_env(
            {
                **self.env,
                "TF_CONFIG": tf_config,
                "JAXPS_METRICS_PORT": str(metrics_port),
                **({"JAXPS_TLS_DIR": str(self.tls_dir(name))} if self.authority else {}),
                **(env or {}),
            }
        )

    def wait(self, *, timeout: float) -> dict[str, int | None]:
        """Waits for every task to exit (None: still running at the deadline)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name, proc in self.processes.items():
            try:
                codes[name] = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def summary(self) -> dict[str, Any]:
        """The chief's last stdout line, parsed."""
        chief = "chief-0" if "chief" in self.spec else "worker-0"
        lines = (self.log_dir / f"{chief}.out").read_text().strip().splitlines()
        if not lines:
            raise RuntimeError(f"{chief} printed no summary; see {self.log_dir}/{chief}.log")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def logs(self) -> str:
        """Every task's log, for a failing test's report."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self, *, timeout: float = 15.0) -> None:
        """SIGTERM what still runs, then SIGKILL after `timeout`: nothing is left behind."""
        if self.standby is not None:
            self.standby.close()
            self.standby = None
        LocalPs(list(self.processes), list(self.processes.values())).stop(timeout=timeout)
