"""`jaxps local`: a TrainingJob on this machine, every pod a process, driven by the planner.

The backend only carries out Plans: each pod becomes `python -m jaxps_runtime` with the pod's
environment, except that TF_CONFIG names 127.0.0.1 and free ports instead of the Service's DNS
names; a deleted pod is a process sent SIGTERM (SIGKILL after a grace period); a process that
exits is a pod Succeeded (0) or Failed (its exit code; death by signal N is 128 + N, as
Kubernetes reports it). Progress comes from the chief's Prometheus metrics. One log per task in
the work directory. Nothing is left running when it returns, Ctrl-C included.

Not thread-safe: one loop drives it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jaxps_operator import planner, progress
from jaxps_runtime import cluster

GRACE_SECONDS = 10.0
TICK_SECONDS = 0.25
KILL = re.compile(r"^(?P<task>(chief|ps|worker|evaluator)-\d+)@step=(?P<step>\d+)$")


class KillSpecError(ValueError):
    """A --kill argument is not TASK@step=N for a task of the job."""


@dataclass(frozen=True)
class Kill:
    task: str
    step: int

    @classmethod
    def parse(cls, text: str, *, job: Mapping[str, Any]) -> Kill:
        """`ps-0@step=200`: the task (role-index), kept as its pod's name."""
        match = KILL.match(text)
        if not match:
            raise KillSpecError(f"--kill {text!r}: expected TASK@step=N, such as ps-0@step=200")
        role, _, index = match["task"].rpartition("-")
        tasks = [f"{r}-{i}" for r, n in planner.replicas(job).items() for i in range(n)]
        if match["task"] not in tasks:
            raise KillSpecError(
                f"--kill {text!r}: the job has no task {match['task']}; its tasks "
                f"are {', '.join(tasks)}"
            )
        return cls(planner.pod_name(job, role, int(index)), int(match["step"]))


@dataclass
class Process:
    role: str
    index: int
    popen: subprocess.Popen[bytes]
    deleting_since: float | None = None

    @property
    def exit_code(self) -> int | None:
        code = self.popen.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code  # -9 (SIGKILL) reads as 137


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalJob:
    """One TrainingJob run as local processes."""

    job: dict[str, Any]
    workdir: Path
    kills: list[Kill] = field(default_factory=list)
    processes: dict[str, Process] = field(default_factory=dict)
    ports: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (grpc, metrics)
    summary: dict[str, Any] | None = None
    events: list[planner.Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.job.setdefault("metadata", {}).setdefault(
            "uid", f"local-{os.getpid()}-{time.time_ns()}"
        )
        self.job["metadata"].setdefault("namespace", "local")
        for role, count in planner.replicas(self.job).items():
            for index in range(count):
                self.ports[planner.pod_name(self.job, role, index)] = (_free_port(), _free_port())
        self._training = self._local_training()

    # --- what the planner sees ---------------------------------------------------------------

    def observe(self) -> list[planner.PodState]:
        pods = []
        for name, proc in list(self.processes.items()):
            code = proc.exit_code
            if proc.deleting_since is not None:
                if code is not None:
                    del self.processes[name]  # gone: the planner may create it again
                    continue
                if time.monotonic() - proc.deleting_since > GRACE_SECONDS:
                    proc.popen.kill()
            phase = "Running" if code is None else ("Succeeded" if code == 0 else "Failed")
            pods.append(
                planner.PodState(
                    name=name,
                    role=proc.role,
                    index=proc.index,
                    phase=phase,
                    ready=code is None,
                    exit_code=code,
                    deleting=proc.deleting_since is not None,
                )
            )
        return pods

    def apply(self, plan: planner.Plan) -> None:
        for name in plan.delete:
            proc = self.processes.get(name)
            if proc is None or proc.deleting_since is not None:
                continue
            if proc.exit_code is not None:
                del self.processes[name]
            else:
                proc.popen.send_signal(signal.SIGTERM)
                proc.deleting_since = time.monotonic()
        for manifest in plan.create:
            if manifest["kind"] == "Pod":
                self._start(manifest)
        self.events += plan.events

    # --- processes --------------------------------------------------------------------------

    def _local_training(self) -> str:
        """spec.training, with a volume-backed checkpoint dir moved into the work dir."""
        training = json.loads(planner.training_json(self.job))
        checkpoint = training.get("checkpoint") or {}
        if checkpoint.get("claimName") or (
            checkpoint.get("dir") and not Path(checkpoint["dir"]).is_absolute()
        ):
            checkpoint["dir"] = str(self.workdir / "checkpoints")
        if training.get("exportPath") and not Path(training["exportPath"]).is_absolute():
            training["exportPath"] = str(self.workdir / training["exportPath"])
        return json.dumps(training, sort_keys=True)

    def _tf_config(self, role: str, index: int) -> str:
        addresses = {
            r: [f"127.0.0.1:{self.ports[planner.pod_name(self.job, r, i)][0]}" for i in range(n)]
            for r, n in planner.replicas(self.job).items()
        }
        return cluster.build_tf_config(cluster=addresses, task_type=role, task_index=index)

    def _start(self, manifest: Mapping[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        labels = manifest["metadata"]["labels"]
        role, index = labels[planner.LABEL_ROLE], int(labels[planner.LABEL_INDEX])
        container = manifest["spec"]["containers"][0]
        env = dict(os.environ)
        env.update({e["name"]: str(e.get("value", "")) for e in container.get("env", [])})
        env.update(
            {
                "TF_CONFIG": self._tf_config(role, index),
                "JAXPS_TRAINING": self._training,
                "JAXPS_METRICS_PORT": str(self.ports[name][1]),
                "JAX_PLATFORMS": env.get("JAX_PLATFORMS", "cpu"),
            }
        )
        runtime_root = str(Path(__file__).resolve().parents[2] / "runtime")
        env["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys(
                [runtime_root, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
            )
        )
        with (self.workdir / f"{name}.log").open("ab") as log:
            log.write(f"--- {datetime.now(UTC).isoformat()} starting {name}\n".encode())
            log.flush()
            argv = [*container.get("command", []), *container.get("args", [])]
            if argv and argv[0] in ("python", "python3"):
                argv[0] = sys.executable  # the interpreter jaxps runs in, with its packages
            popen = subprocess.Popen(
                argv or [sys.executable, "-m", "jaxps_runtime"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.processes[name] = Process(role=role, index=index, popen=popen)

    def kill_due(self, step: float) -> list[str]:
        """SIGKILLs the tasks whose --kill step is reached (each once); their names."""
        done = []
        for kill in list(self.kills):
            proc = self.processes.get(kill.task)
            if step >= kill.step and proc is not None and proc.exit_code is None:
                proc.popen.send_signal(signal.SIGKILL)
                self.kills.remove(kill)
                done.append(kill.task)
        return done

    def stop_all(self) -> None:
        for proc in self.processes.values():
            if proc.exit_code is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for proc in self.processes.values():
            try:
                proc.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    # --- progress ---------------------------------------------------------------------------

    def chief_name(self) -> str:
        return planner.pod_name(self.job, *planner.chief_task(self.job))

    def progress(self) -> dict[str, Any]:
        metrics = progress.read_metrics("127.0.0.1", self.ports[self.chief_name()][1])
        current = progress.merge(self.job.get("status", {}).get("progress") or {}, metrics)
        summary = self.read_summary()
        return current if summary is None else progress.final(current, summary)

    def read_summary(self) -> dict[str, Any] | None:
        """The chief's `{"event": "done", ...}` line, once it printed it."""
        if self.summary is not None:
            return self.summary
        log = self.workdir / f"{self.chief_name()}.log"
        if not log.exists():
            return None
        self.summary = progress.summary(log.read_text(errors="replace"))
        return self.summary


def run(
    job: dict[str, Any], *, workdir: Path, kills: list[Kill], on_tick: Any = None
) -> dict[str, Any]:
    """Runs the job to the end; returns its final status. Stops every process on the way out."""
    local = LocalJob(job=job, workdir=workdir, kills=kills)
    job.setdefault("status", {})
    try:
        while True:
            observed = local.observe()
            plan = planner.plan(
                job,
                observed,
                datetime.now(UTC),
                service_exists=bool(job["status"].get("conditions")),
            )
            local.apply(plan)
            job["status"] = plan.status
            job["status"]["progress"] = local.progress()
            step = job["status"]["progress"].get("step", 0)
            for task in local.kill_due(step):
                local.events.append(
                    planner.Event(
                        "Warning", "KilledOnRequest", f"--kill: SIGKILL {task} at step {step}"
                    )
                )
            if on_tick is not None:
                on_tick(job, local)
            finished = job["status"]["state"] in planner.TERMINAL
            if finished and not any(
                p.exit_code is None
                for p in local.processes.values()
                if p.deleting_since is not None
            ):
                running = [n for n, p in local.processes.items() if p.exit_code is None]
                if (
                    not running
                    or plan.delete_job
                    or job["spec"]["runPolicy"]["cleanPodPolicy"] == "None"
                ):
                    final: dict[str, Any] = job["status"]
                    return final
            time.sleep(TICK_SECONDS)
    finally:
        local.stop_all()
