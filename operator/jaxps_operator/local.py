"""`jaxps local`: a TrainingJob on this machine, the reconcile pass in a loop over processes.

`LocalCluster` is the local adapter of the `Cluster` port, a kubelet and an API server of one
job: the stored job is a dict; a created pod is `python -m jaxps_runtime` (its container's
command) with the pod's environment exactly as the builder made it, plus what a node gives a
container (`processes.node_env`: JAX_PLATFORMS=cpu unless set, the runtime on PYTHONPATH; and
JAXPS_TERMINATION_LOG: its termination-message file), started as `processes` starts every
local task; the Service is the job's port table: every task gets 127.0.0.1 and two free ports
(gRPC, metrics), all reserved at once so no two tasks share one; the Secret is the job's
credentials, issued at start into `tls/<pod>` of the work directory, for every worker the job
may ever have (`capacity`: maxReplicas, else its replicas) (each task's directory
holds its own key and the CA only; keys readable by their owner); a deleted pod is a process
sent SIGTERM (SIGKILL after a grace period); a process that exits is a pod Succeeded (0) or
Failed (its exit code; death by signal N is 128 + N, as Kubernetes reports it) and Ready once
its readiness probe (an HTTP GET on its metrics port) first answers 200. One log per task in
the work directory, next to the stored job (`job.json`, status included) and its Events
(`events.jsonl`), which `jaxps.sdk` reads. The workers scale as `kubectl scale` scales them:
`--scale worker=N@step=S`, or `jaxps.sdk`'s scale, whose request file (`requests/`) each tick
answers; a removed worker is a process sent SIGTERM, as a deleted pod. Nothing is left running
when `run` returns, Ctrl-C and SIGTERM included.

Not thread-safe: one loop drives it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jaxps_operator import (
    builders,
    capacity,
    conditions,
    issuer,
    kueue,
    processes,
    progress,
    reconcile,
    schema,
)
from jaxps_operator.conditions import TERMINAL, Event
from jaxps_operator.objects import PodState
from jaxps_operator.reconcile import Children
from jaxps_runtime.config import cluster
from jaxps_runtime.wire import credentials

GRACE_SECONDS = processes.GRACE_SECONDS
JOB_FILE = "job.json"  # the stored job (metadata, spec, status), rewritten on every change
EVENTS_FILE = "events.jsonl"  # one Event per line, with its time
TICK_SECONDS = 0.25
KILL = re.compile(r"^(?P<task>(chief|ps|worker|evaluator)-\d+)@step=(?P<step>\d+)$")
SCALE = re.compile(r"^worker=(?P<workers>\d+)@step=(?P<step>\d+)$")
# `jaxps.sdk`'s scale of a running local job: a request file in the work directory, which the
# runner takes on its next tick and answers with a file of the same name + ANSWER
REQUESTS_DIR = "requests"
ANSWER = ".answer"


class KillSpecError(ValueError):
    """A --kill argument is not TASK@step=N for a task of the job and a step it reaches."""


class ScaleSpecError(ValueError):
    """A --scale argument is not worker=N@step=S with N workers the job may have and a step
    it reaches."""


class WorkdirError(ValueError):
    """A --workdir that cannot hold the job's files; the message names the path and why."""


class WorkdirGoneError(RuntimeError):
    """The work directory was removed while the job ran: the run stops every task."""


@dataclass(frozen=True)
class Kill:
    task: str
    step: int

    @classmethod
    def parse(cls, text: str, *, job: Mapping[str, Any]) -> Kill:
        """`ps-0@step=200`: the task (role-index), kept as its pod's name. A step past the
        job's last (`spec.training.steps`) is refused: the job would end without the kill."""
        match = KILL.match(text)
        if not match:
            raise KillSpecError(f"--kill {text!r}: expected TASK@step=N, such as ps-0@step=200")
        role, _, index = match["task"].rpartition("-")
        # a worker that joins in a scale-up may be killed too
        tasks = [f"{r}-{i}" for r, i in builders.tasks(capacity.at_capacity(job))]
        if match["task"] not in tasks:
            raise KillSpecError(
                f"--kill {text!r}: the job has no task {match['task']}; its tasks "
                f"are {', '.join(tasks)}"
            )
        step, last = int(match["step"]), int(job["spec"]["training"]["steps"])
        if step > last:
            raise KillSpecError(
                f"--kill {text!r}: step {step} is past the job's last step {last} "
                f"(spec.training.steps); expected a step in 0..{last}"
            )
        return cls(builders.pod_name(job, role, int(index)), step)


@dataclass(frozen=True)
class Scale:
    workers: int
    step: int

    @classmethod
    def parse(cls, text: str, *, job: Mapping[str, Any]) -> Scale:
        """`worker=4@step=100`: the job's worker replicas become 4 when the chief reaches step
        100. Refused before the job starts: another form, a count the job may not have
        (minReplicas..maxReplicas, or the replicas at creation without maxReplicas), a step
        past the job's last."""
        match = SCALE.match(text)
        if not match:
            raise ScaleSpecError(
                f"--scale {text!r}: expected worker=N@step=S, such as worker=4@step=100 "
                "(only workers scale)"
            )
        workers, step = int(match["workers"]), int(match["step"])
        why = capacity.refusal(job, workers, issued_workers=None)
        if why is not None:
            raise ScaleSpecError(f"--scale {text!r}: {why}")
        last = int(job["spec"]["training"]["steps"])
        if step > last:
            raise ScaleSpecError(
                f"--scale {text!r}: step {step} is past the job's last step {last} "
                f"(spec.training.steps); expected a step in 0..{last}"
            )
        return cls(workers, step)


def default_workdir(name: str, *, root: Path, now: float | None = None) -> Path:
    """A new directory `root/<name>-<time>` (then `-2`, `-3`, ...: two runs started in the
    same second never share one), created here: mkdir is the atomic test, so two processes
    racing for the same name each get their own."""
    base = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    root.mkdir(parents=True, exist_ok=True)
    for attempt in itertools.count(1):
        path = root / (base if attempt == 1 else f"{base}-{attempt}")
        try:
            path.mkdir(exist_ok=False)
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")  # itertools.count never ends


def usable_workdir(path: Path) -> Path:
    """`path`, created if missing, once it is a directory this process can write; else
    `WorkdirError` naming the path and why (a file there, a file above it, no permission)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise WorkdirError(f"--workdir {path}: it is a file, not a directory") from None
    except NotADirectoryError:
        above = next((p for p in path.parents if p.exists() and not p.is_dir()), path.parent)
        raise WorkdirError(
            f"--workdir {path}: {above} is a file, so nothing can be created under it"
        ) from None
    except OSError as err:
        raise WorkdirError(f"--workdir {path}: cannot create it: {err.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise WorkdirError(f"--workdir {path}: this user cannot write in it (permission denied)")
    return path


NUMBER_MAPS = frozenset({"eval"})  # keys whose dicts map names to numbers: no room for a note


def finite(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, numbers, strings) with every non-finite number (NaN,
    infinity) replaced by None and a `note` naming it (`"loss was not finite"`) in the dict
    that holds it; a number of a map (`progress.eval`, `NUMBER_MAPS`) is noted in the dict
    above (`"eval.accuracy was not finite"` in `progress`), as the CRD has no note in a map.
    JSON has no NaN: what `strict_json` writes parses anywhere."""
    converted, lost = _finite(value, kind="")
    if lost and isinstance(converted, dict):
        _note(converted, lost)
    return converted


def strict_json(value: Any, **dumps: Any) -> str:
    """`json.dumps` of `finite(value)`, refusing any NaN left (there is none)."""
    return json.dumps(finite(value), allow_nan=False, **dumps)


def _finite(value: Any, *, kind: str) -> tuple[Any, list[str]]:
    """The converted value (found under the key `kind`) and the paths, relative to it, of the
    numbers it lost that no dict inside it took a note for."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, [""]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        lost: list[str] = []
        for key, item in value.items():
            out[key], paths = _finite(item, kind=str(key))
            lost += [f"{key}.{p}" if p else str(key) for p in paths]
        if lost and kind not in NUMBER_MAPS:
            _note(out, lost)
            lost = []
        return out, lost
    if isinstance(value, list | tuple):
        items, lost = [], []
        for index, item in enumerate(value):
            converted, paths = _finite(item, kind=kind)
            items.append(converted)
            lost += [f"{index}.{p}" if p else str(index) for p in paths]
        return items, lost
    return value, []


def _note(holder: dict[str, Any], paths: list[str]) -> None:
    said = f"{', '.join(paths)} {'was' if len(paths) == 1 else 'were'} not finite"
    holder["note"] = f"{holder['note']}; {said}" if holder.get("note") else said


@dataclass
class Process:
    role: str
    index: int
    popen: subprocess.Popen[bytes]
    termination_log: Path
    ready_url: str | None = None  # the readiness probe; None: ready while it runs
    deleting_since: float | None = None
    ready: bool = False

    def probe(self) -> bool:
        """Whether the task is ready: running, and its readiness probe answered 200 once (a
        task that was ready stays so until it exits; the GET waits 0.2 s at most)."""
        if self.exit_code is not None:
            return False
        if not self.ready:
            if self.ready_url is None:
                self.ready = True
            else:
                try:
                    with urllib.request.urlopen(self.ready_url, timeout=0.2) as answer:
                        self.ready = answer.status == 200
                except OSError:  # not yet listening, not yet ready (URLError is an OSError)
                    pass
        return self.ready

    @property
    def exit_code(self) -> int | None:
        return processes.exit_code(self.popen)  # -9 (SIGKILL) reads as 137


def local_job(job: Mapping[str, Any], workdir: Path) -> dict[str, Any]:
    """The job as this machine runs it: an identity, and a volume-backed or relative checkpoint
    dir (and export path, and TensorBoard dir: `tensorboard` by default) moved into the work
    directory, where every task finds it."""
    out = copy.deepcopy(dict(job))
    meta = out.setdefault("metadata", {})
    meta.setdefault("uid", f"local-{os.getpid()}-{time.time_ns()}")
    meta.setdefault("namespace", "local")
    meta.setdefault("generation", 1)
    training = out["spec"]["training"]
    checkpoint = training.get("checkpoint") or {}
    if checkpoint.get("claimName") or (
        checkpoint.get("dir") and not Path(checkpoint["dir"]).is_absolute()
    ):
        checkpoint["dir"] = str(workdir / "checkpoints")
    if training.get("exportPath") and not Path(training["exportPath"]).is_absolute():
        training["exportPath"] = str(workdir / training["exportPath"])
    board = training.get("tensorboard") or {}
    if not board.get("dir") or not Path(board["dir"]).is_absolute():
        training["tensorboard"] = {
            **board,
            "dir": str(workdir / (board.get("dir") or "tensorboard")),
        }
    out["status"] = {}
    return out


@dataclass
class LocalCluster:
    """The `Cluster` of one job run as local processes."""

    job: dict[str, Any]  # as stored: metadata, spec, status
    workdir: Path
    processes: dict[str, Process] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    service: dict[str, Any] | None = None
    deleted: bool = False

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # the pods' processes, and a ps loaded ahead which a replaced ps becomes
        self.launched = processes.Processes(standby_log=self.workdir / "standby.log")
        # every worker the job may ever have gets its ports and its certificate now: the CA's
        # key is dropped once they are issued
        full = capacity.at_capacity(self.job)
        names = [builders.pod_name(full, r, i) for r, i in builders.tasks(full)]
        ports = cluster.free_ports(2 * len(names))
        self.ports = {n: (ports[2 * k], ports[2 * k + 1]) for k, n in enumerate(names)}
        files = self.credentials(full, self.network(full))
        self.issued_workers = capacity.issued_workers(files, self.job)
        self._write_credentials(files)
        self.save()

    # --- the port -----------------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None if self.deleted else copy.deepcopy(self.job)

    def children(self, job: Mapping[str, Any]) -> Children:
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
                PodState(
                    name=name,
                    role=proc.role,
                    index=proc.index,
                    phase=phase,
                    ready=proc.probe(),
                    exit_code=code,
                    deleting=proc.deleting_since is not None,
                    message=_read(proc.termination_log) if code is not None else "",
                    metrics=f"127.0.0.1:{self.ports[name][1]}" if code is None else None,
                )
            )
        # credentials: made at start
        return Children(
            pods=pods, service=self.service is not None, issued_workers=self.issued_workers
        )

    def network(self, job: Mapping[str, Any]) -> builders.Network:
        return builders.Network(
            addresses={
                role: [
                    f"127.0.0.1:{self.ports[builders.pod_name(job, role, i)][0]}"
                    for i in range(count)
                ]
                for role, count in builders.replicas(job).items()
            },
            metrics_ports={name: metrics for name, (_, metrics) in self.ports.items()},
            tls_dirs={name: str(self.tls_dir(name)) for name in self.ports},
        )

    def credentials(self, job: Mapping[str, Any], network: builders.Network) -> dict[str, bytes]:
        return issuer.issue(job, network)

    def create(self, job: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
        name = manifest["metadata"]["name"]
        if manifest["kind"] == "Service":
            if self.service is not None:
                return False
            self.service = dict(manifest)
            return True
        if name in self.processes:
            return False
        self._start(manifest)
        return True

    def delete_pod(self, job: Mapping[str, Any], name: str, *, force: bool = False) -> bool:
        proc = self.processes.get(name)
        if proc is None:
            return False
        if proc.deleting_since is None:
            if proc.exit_code is not None:
                del self.processes[name]
            else:
                proc.popen.send_signal(signal.SIGTERM)
                proc.deleting_since = time.monotonic()
        return True

    def write_status(self, job: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        self.job["status"] = copy.deepcopy(dict(status))
        self.save()

    def post_event(self, job: Mapping[str, Any], event: Event) -> None:
        self.events.append(event)
        record = {"time": conditions.stamp(datetime.now(UTC)), **dataclasses.asdict(event)}
        with (self.workdir / EVENTS_FILE).open("a") as out:
            out.write(strict_json(record) + "\n")

    def save(self) -> None:
        """The stored job, status included, as `JOB_FILE` of the work directory (replaced
        whole: a reader never sees half of it): what `jaxps.sdk` reads of a local job."""
        stored = {**self.job, "tasks": {n: str(self.workdir / f"{n}.log") for n in self.ports}}
        partial = self.workdir / f".{JOB_FILE}.partial"
        partial.write_text(strict_json(stored, indent=1, sort_keys=True))
        partial.replace(self.workdir / JOB_FILE)

    def delete_job(self, job: Mapping[str, Any]) -> None:
        self.deleted = True
        for name in list(self.processes):
            self.delete_pod(job, name)

    def task_progress(self, pod: PodState) -> dict[str, float]:
        return progress.of_task(pod)

    # --- processes ----------------------------------------------------------------------------

    def tls_dir(self, pod: str) -> Path:
        return self.workdir / "tls" / pod

    def _write_credentials(self, files: Mapping[str, bytes]) -> None:
        """Each task's directory: the CA, its certificate and its key, as its Secret volume
        would hold them on Kubernetes."""
        for pod in self.ports:
            credentials.TaskCredentials(
                ca=files[builders.CA_FILE],
                cert=files[builders.cert_key(pod)],
                key=files[builders.key_key(pod)],
            ).write(self.tls_dir(pod))

    def _start(self, manifest: Mapping[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        labels = manifest["metadata"]["labels"]
        role, index = labels[builders.LABEL_ROLE], int(labels[builders.LABEL_INDEX])
        container = builders.main_container(manifest["spec"])
        termination_log = self.workdir / f"{name}.termination-log"
        termination_log.write_text("")  # as the kubelet creates it: the task writes if it exists
        env = processes.node_env(
            {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}
        )
        env["JAXPS_TERMINATION_LOG"] = str(termination_log)
        # a pod's own standby ps (process.keeper): here the job keeps one for all its ps
        env.pop(builders.STANDBY_ENV, None)
        argv = [*container.get("command", []), *container.get("args", [])]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # the interpreter jaxps runs in, with its packages
        argv = argv or [sys.executable, "-m", "jaxps_runtime"]
        log = self.workdir / f"{name}.log"
        with log.open("ab") as header:
            header.write(f"--- {datetime.now(UTC).isoformat()} starting {name}\n".encode())
        popen = self.launched.start(name, env=env, argv=argv, stdout=log, ps=role == cluster.PS)
        self.processes[name] = Process(
            role=role,
            index=index,
            popen=popen,
            termination_log=termination_log,
            ready_url=self._ready_url(name, container),
        )

    def _ready_url(self, name: str, container: Mapping[str, Any]) -> str | None:
        """The container's HTTP readiness probe on this machine; its port by number or by
        the name of one of its ports."""
        get = (container.get("readinessProbe") or {}).get("httpGet")
        if not get:
            return None
        port = get.get("port")
        if isinstance(port, str):
            named = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
            port = named.get(port)
        if not isinstance(port, int):
            return None
        return f"http://127.0.0.1:{port}{get.get('path', '/')}"

    def scale(self, workers: int) -> str | None:
        """Sets the job's worker replicas, as `kubectl scale` does: checked as the apiserver
        checks an update (the CRD's rules, the ps count included) and against the workers
        issued at start; the next pass adds or removes the processes. Returns why it is
        refused (also an Event), or None."""
        before = int(self.job["spec"]["replicaSpecs"][capacity.WORKER]["replicas"])
        why = capacity.refusal(self.job, workers, issued_workers=self.issued_workers)
        if why is None:
            changed = copy.deepcopy(self.job)
            changed["spec"]["replicaSpecs"][capacity.WORKER]["replicas"] = workers
            try:
                schema.validate({k: v for k, v in changed.items() if k != "status"}, old=self.job)
            except schema.InvalidManifestError as err:
                why = "; ".join(str(p) for p in err.problems)
        if why is not None:
            self.post_event(self.job, Event("Warning", "ScaleRefused", why))
            return why
        if workers != before:
            self.job["spec"]["replicaSpecs"][capacity.WORKER]["replicas"] = workers
            meta = self.job["metadata"]
            meta["generation"] = int(meta.get("generation", 1)) + 1
            self.save()
        return None

    def scale_due(self, step: float, scales: list[Scale]) -> list[tuple[Scale, str | None]]:
        """Carries out the --scale requests whose step is reached (each once), in order:
        each with why it was refused, or None."""
        done = []
        for request in sorted(scales, key=lambda r: r.step):
            if step >= request.step:
                scales.remove(request)
                done.append((request, self.scale(request.workers)))
        return done

    def answer_requests(self) -> None:
        """Takes `jaxps.sdk`'s scale requests (`requests/<id>.json`: {"workers": N}) and
        answers each (`requests/<id>.json.answer`: {"refused": why or null})."""
        folder = self.workdir / REQUESTS_DIR
        if not folder.is_dir():
            return
        for request in sorted(folder.glob("*.json")):
            answer = request.with_name(request.name + ANSWER)
            if answer.exists():
                continue
            try:
                workers = json.loads(request.read_text())["workers"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # still being written: the writer renames it into place
            why = (
                self.scale(workers)
                if isinstance(workers, int) and not isinstance(workers, bool)
                else f"{capacity.REPLICAS} {workers!r} is not an integer"
            )
            partial = answer.with_name(f".{answer.name}.partial")
            partial.write_text(json.dumps({"refused": why}))
            partial.replace(answer)

    def kill_due(self, step: float, kills: list[Kill]) -> list[str]:
        """SIGKILLs the tasks whose --kill step is reached (each once); their names."""
        done = []
        for kill in list(kills):
            proc = self.processes.get(kill.task)
            if step >= kill.step and proc is not None and proc.exit_code is None:
                proc.popen.send_signal(signal.SIGKILL)
                kills.remove(kill)
                done.append(kill.task)
        return done

    def stopping(self) -> bool:
        """Whether a deleted process is still on its way out."""
        return any(
            p.exit_code is None for p in self.processes.values() if p.deleting_since is not None
        )

    def running(self) -> list[str]:
        return [n for n, p in self.processes.items() if p.exit_code is None]

    def stop_all(self) -> None:
        """Ends the standby and every process still running (SIGTERM, SIGKILL after the grace
        period), those on their way out included."""
        self.launched.stop_all(last={n for n, p in self.processes.items() if p.role == "ps"})


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def run(
    job: Mapping[str, Any],
    *,
    workdir: Path,
    kills: list[Kill],
    scales: list[Scale] | None = None,
    on_tick: Callable[[dict[str, Any], LocalCluster], None] | None = None,
) -> dict[str, Any]:
    """Runs the job (validated, defaults applied) to the end; returns its final status. Stops
    every process on the way out."""
    local = LocalCluster(job=local_job(job, workdir), workdir=workdir)
    meta = local.job["metadata"]
    if kueue.queue_name(local.job):  # no Kueue on one machine: said once, as an Event
        local.post_event(
            local.job,
            Event(
                "Normal",
                "QueueIgnored",
                f"label {kueue.QUEUE_LABEL}={kueue.queue_name(local.job)} ignored: "
                "jaxps local has no Kueue; the job starts at once",
            ),
        )
    validator = reconcile.Validator()
    kills = list(kills)
    scales = list(scales or [])
    gone = WorkdirGoneError(
        f"the work directory {local.workdir} was removed while the job ran (its logs, TLS "
        "files and the tasks' last words were there): every task stopped"
    )
    try:
        while True:
            if not local.workdir.is_dir():
                raise gone
            # a scale is carried out by the pass that follows it: processes join or leave
            reached = (local.job["status"].get("progress") or {}).get("step", 0)
            for request, why in local.scale_due(reached, scales):
                if why is None:
                    local.post_event(
                        local.job,
                        Event(
                            "Normal",
                            "ScaledOnRequest",
                            f"--scale: worker replicas {request.workers} at step {reached}",
                        ),
                    )
            local.answer_requests()
            outcome = reconcile.reconcile(
                local, meta["namespace"], meta["name"], now=datetime.now(UTC), validator=validator
            )
            status = local.job["status"]
            step = (status.get("progress") or {}).get("step", 0)
            for task in local.kill_due(step, kills):
                local.post_event(
                    local.job,
                    Event("Warning", "KilledOnRequest", f"--kill: SIGKILL {task} at step {step}"),
                )
            if on_tick is not None:
                on_tick(local.job, local)
            over = outcome.state is None or outcome.state in TERMINAL
            if over:  # no ps will be replaced any more
                local.launched.close_standby()
            if (
                over
                and not local.stopping()
                and (
                    outcome.state is None
                    or not local.running()
                    or local.job["spec"]["runPolicy"]["cleanPodPolicy"] == "None"
                )
            ):
                final: dict[str, Any] = local.job["status"]
                return final
            time.sleep(TICK_SECONDS)
    except FileNotFoundError as err:  # a file of the pass, as the directory went
        if local.workdir.is_dir():
            raise
        raise gone from err
    finally:
        local.stop_all()
