"""Bare runtime tasks on 127.0.0.1 for the process tests and the benchmarks.

A thin layer on `jaxps_operator.processes`, the one way jaxps starts, stops and reaps local
processes (`jaxps local` runs its pods with it): here tasks are started by hand, with the ports,
credentials and environment a test chooses, and can be killed and started again. Tasks run
plaintext (JAXPS_INSECURE=1) unless given credentials (`LocalJob.start(tls=True)`). What gRPC
adds, waiting for a task's health service to answer SERVING, lives here: the operator never
imports gRPC. The benchmarks import this module with the repository root on sys.path.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxps_operator import processes
from jaxps_runtime.config import cluster
from jaxps_runtime.process.standby import RUNTIME, Standby
from jaxps_runtime.wire import credentials, rpc

STOP_SECONDS = 15.0  # from SIGTERM to SIGKILL when a test stops its tasks


def runtime_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A task's environment: what a node gives it (`processes.node_env`), plaintext unless the
    task is given credentials, then `extra` (which replaces any of it, PYTHONPATH included)."""
    env = processes.node_env()
    env.setdefault("JAXPS_INSECURE", "1")  # tasks given credentials (tls=True) use them
    env.update(extra or {})
    return env


def wait_serving(
    address: str,
    *,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    credentials: credentials.TaskCredentials | None = None,
) -> None:
    """Waits for the standard gRPC health service at `address` to report SERVING (asking
    over mutual TLS with `credentials`)."""
    deadline = time.monotonic() + timeout
    with rpc.channel(address, credentials) as channel:
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
    """ps processes of one job on 127.0.0.1 (a test may replace one in `processes`)."""

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
        tls: Path | None = None,
    ) -> LocalPs:
        """Starts `num_ps` ps (output in `log_dir/ps-<i>.log`, or discarded) of a job that
        also has `workers` workers, and waits until every one is SERVING; with `tls`, over
        mutual TLS, in a job with an evaluator too, each task's credentials in `tls/<task>`."""
        ports = cluster.free_ports(num_ps + workers + 1)
        spec = {
            "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
            "worker": [f"127.0.0.1:{p}" for p in ports[num_ps : num_ps + workers]],
        }
        if tls is not None:
            spec["evaluator"] = [f"127.0.0.1:{ports[-1]}"]
            authority = credentials.authority(job_id)
            for role, addresses in spec.items():
                for i in range(len(addresses)):
                    identity = credentials.Identity(job=job_id, role=role, index=i)
                    issued = credentials.issue(authority, identity, hosts=["127.0.0.1"])
                    issued.write(tls / f"{role}-{i}")
        running = cls(spec["ps"], [])
        for i in range(num_ps):
            tf_config = cluster.build_tf_config(cluster=spec, task_type="ps", task_index=i)
            env = runtime_env({"TF_CONFIG": tf_config, "JAXPS_JOB_UID": job_id})
            if tls is not None:
                env["JAXPS_TLS_DIR"] = str(tls / f"ps-{i}")
            running.processes.append(
                processes.start(
                    RUNTIME, env=env, stdout=log_dir / f"ps-{i}.log" if log_dir else None
                )
            )
        caller = None if tls is None else credentials.TaskCredentials.load(tls / "worker-0")
        try:
            for address, proc in zip(running.addresses, running.processes, strict=True):
                wait_serving(address, timeout=timeout, process=proc, credentials=caller)
        except BaseException:
            running.stop()
            raise
        return running

    def stop(self, *, timeout: float = STOP_SECONDS) -> list[int | None]:
        """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit codes."""
        return processes.stop(self.processes, grace=timeout)

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
    log_dir: Path
    env: dict[str, str]
    tasks: processes.Processes  # the started processes by task name, and the standby ps
    metrics_ports: dict[str, int] = field(default_factory=dict)
    authority: credentials.Authority | None = None  # the job's CA when it runs with mutual TLS

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
        `standby`, the job keeps a ps loaded ahead (`processes.Processes`), which a ps started
        again (`start_task`) becomes.
        """
        counts = {"chief": int(chief), "ps": ps, "worker": workers, "evaluator": int(evaluator)}
        ports = iter(cluster.free_ports(2 * sum(counts.values())))
        spec = {
            role: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for role, n in counts.items() if n
        }
        env = {"JAXPS_JOB_UID": job_id, "JAXPS_TRAINING": json.dumps(training), **(extra_env or {})}
        log_dir.mkdir(parents=True, exist_ok=True)
        job = cls(
            spec=spec,
            log_dir=log_dir,
            env=env,
            tasks=processes.Processes(standby_log=log_dir / "standby.log" if standby else None),
        )
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
        return job

    @property
    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """Each task's latest process, by task name."""
        return self.tasks.popens

    @property
    def standby(self) -> Standby | None:
        """The ps loaded ahead (with `start(standby=True)`), once a ps has started."""
        return self.tasks.standby

    def tls_dir(self, name: str) -> Path:
        """Where task `name`'s credentials are (with `tls`)."""
        return self.log_dir / "tls" / name

    def start_task(
        self, name: str, *, metrics_port: int = 0, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Starts (or starts again) one task; its stdout goes to <name>.out, logs to <name>.log.
        A ps becomes the job's standby when it has one that fits (then a new one is started)."""
        self.metrics_ports[name] = metrics_port
        return self.tasks.start(
            name,
            env=self.task_env(name, metrics_port=metrics_port, env=env),
            stdout=self.log_dir / f"{name}.out",
            stderr=self.log_dir / f"{name}.log",
            ps=name.startswith("ps-"),
        )

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

    def stop(self, *, timeout: float = STOP_SECONDS) -> None:
        """SIGTERM what still runs, then SIGKILL after `timeout`: nothing is left behind."""
        self.tasks.stop_all(grace=timeout)
