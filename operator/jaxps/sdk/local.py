"""The SDK's local backend: each job is a background `jaxps local` in `root/<name>`.

`create` writes the manifest to `root/<name>/manifest.yaml` and starts `python -m
jaxps_operator local` on it in its own session (so a notebook's Ctrl-C does not reach it),
with its output in `root/<name>/jaxps-local.log` and its pid in `runner.pid`. That process runs
the same reconcile pass as `jaxps local` in a terminal and keeps the stored job, status
included, in `job.json` and its Events in `events.jsonl`: `get`, `events` and `logs` only read
files; `scale` writes a request file the runner answers on its next tick. `delete` sends it
SIGTERM (it stops every task, SIGKILL after a grace period) and removes the directory. A
runner that died without finishing the job (SIGKILL, a reboot) reads as Failed with reason
`LocalRunnerExited`.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from jaxps.sdk.model import (
    Event,
    JaxpsError,
    Job,
    JobExistsError,
    JobNotFoundError,
    LogLine,
    ScaleRefusedError,
    parse_time,
    task_pods,
)
from jaxps_operator.local import ANSWER, EVENTS_FILE, GRACE_SECONDS, JOB_FILE, REQUESTS_DIR

MANIFEST, RUNNER_LOG, PID_FILE = "manifest.yaml", "jaxps-local.log", "runner.pid"
START_SECONDS = 60.0  # for the runner to write job.json (it imports the operator, not JAX)
ANSWER_SECONDS = 30.0  # for the runner to answer a scale request (it does on each tick)
POLL_SECONDS = 0.2


class LocalBackend:
    def __init__(self, root: Path | None = None) -> None:
        if root is None:
            data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
            root = Path(data) / "jaxps" / "local"
        self.root = root.expanduser().resolve()
        self.where = str(self.root)

    # --- the port ---------------------------------------------------------------------------

    def create(self, manifest: Mapping[str, Any]) -> Job:
        name = manifest["metadata"]["name"]
        workdir = self.root / name
        if workdir.exists():
            if self._alive(workdir) or not (workdir / JOB_FILE).exists():
                raise JobExistsError(name, self.where)
            raise JobExistsError(name, f"{self.where} (finished; its files are in {workdir})")
        workdir.mkdir(parents=True)
        (workdir / MANIFEST).write_text(yaml.safe_dump(dict(manifest), sort_keys=False))
        with (workdir / RUNNER_LOG).open("ab") as out:
            runner = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxps_operator",
                    "local",
                    str(workdir / MANIFEST),
                    "--workdir",
                    str(workdir),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (workdir / PID_FILE).write_text(str(runner.pid))
        deadline = time.monotonic() + START_SECONDS
        while not (workdir / JOB_FILE).exists():
            if runner.poll() is not None:
                raise JaxpsError(
                    f"TrainingJob {name}: jaxps local exited {runner.returncode} at start: "
                    f"{_tail(workdir / RUNNER_LOG)}"
                )
            if time.monotonic() > deadline:
                raise JaxpsError(f"TrainingJob {name}: jaxps local did not start; see {workdir}")
            time.sleep(POLL_SECONDS)
        return self.get(name)

    def get(self, name: str, *, timeout: float | None = None) -> Job:
        """`timeout` is the port's; reading a file takes none."""
        workdir = self._workdir(name)
        raw = _read_json(workdir / JOB_FILE)
        if raw is None:
            raise JobNotFoundError(name, self.where)
        state = (raw.get("status") or {}).get("state")
        if state not in ("Succeeded", "Failed") and not self._alive(workdir):
            raw = _runner_exited(raw, workdir)
        return Job.of(raw)

    def list(self) -> builtins.list[Job]:
        if not self.root.is_dir():
            return []
        names = sorted(p.parent.name for p in self.root.glob(f"*/{JOB_FILE}"))
        return [self.get(n) for n in names]

    def delete(self, name: str, *, wait: bool) -> None:
        workdir = self._workdir(name)
        # only a runner still running: the pid of one that exited may be another process now
        pid = self._pid(workdir) if self._alive(workdir) else None
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pid = None
        if pid is not None and wait:
            deadline = time.monotonic() + GRACE_SECONDS + 10
            while self._alive(workdir) and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
            if self._alive(workdir):  # the runner is stuck: its whole session goes
                os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)

    def scale(self, name: str, workers: int) -> None:
        """A request file the job's runner takes on its next tick (`jaxps_operator.local`):
        it sets the worker replicas, checked as the operator checks them, and answers."""
        workdir = self._workdir(name)
        if not self._alive(workdir):
            raise JaxpsError(f"TrainingJob {name}: its jaxps local process is gone")
        folder = workdir / REQUESTS_DIR
        folder.mkdir(exist_ok=True)
        request = folder / f"{time.time_ns()}-{os.getpid()}.json"
        partial = folder / f".{request.name}.partial"
        partial.write_text(json.dumps({"workers": workers}))
        partial.replace(request)  # whole, or not there: the runner never reads half of it
        answer = request.with_name(request.name + ANSWER)
        deadline = time.monotonic() + ANSWER_SECONDS
        while not answer.exists():
            if not self._alive(workdir) or time.monotonic() > deadline:
                raise JaxpsError(
                    f"TrainingJob {name}: jaxps local did not answer the scale to {workers} "
                    f"workers; see {workdir / RUNNER_LOG}"
                )
            time.sleep(POLL_SECONDS)
        refused = (_read_json(answer) or {}).get("refused")
        if refused:
            raise ScaleRefusedError(name, workers, str(refused))

    def events(self, name: str) -> builtins.list[Event]:
        workdir = self._workdir(name)
        out = []
        try:
            lines = (workdir / EVENTS_FILE).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            out.append(
                Event(
                    type=record["type"],
                    reason=record["reason"],
                    message=record["message"],
                    time=parse_time(record.get("time")),
                )
            )
        return out

    def logs(self, name: str, *, task: str | None, follow: bool) -> Iterator[LogLine]:
        workdir = self._workdir(name)
        tasks = task_pods(self.get(name).raw, task)
        return _follow(
            {t: workdir / f"{t}.log" for t in tasks},
            follow=lambda: follow and self._alive(workdir),
        )

    # --- files and the runner ---------------------------------------------------------------

    def _workdir(self, name: str) -> Path:
        workdir = self.root / name
        if "/" in name or not (workdir / JOB_FILE).exists():
            raise JobNotFoundError(name, self.where)
        return workdir

    @staticmethod
    def _pid(workdir: Path) -> int | None:
        try:
            return int((workdir / PID_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _alive(self, workdir: Path) -> bool:
        """Whether the job's runner still runs (reaped if it was our child)."""
        pid = self._pid(workdir)
        if pid is None:
            return False
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return False
        except ChildProcessError:  # not our child: another notebook, a shell
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return "jaxps_operator" in _command_line(pid)


def _follow(files: Mapping[str, Path], *, follow: Any) -> Iterator[LogLine]:
    """Every line of each file, in turn; then, while `follow()`, new lines as they come."""
    offsets = dict.fromkeys(files, 0)
    partial = dict.fromkeys(files, "")
    while True:
        grew = False
        for task, path in files.items():
            try:
                with path.open("rb") as f:
                    f.seek(offsets[task])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            grew = True
            offsets[task] += len(chunk)
            *lines, partial[task] = (partial[task] + chunk.decode(errors="replace")).split("\n")
            for line in lines:
                yield LogLine(task=task, text=line)
        if not grew:
            if not follow():
                break
            time.sleep(POLL_SECONDS)
    for task, rest in partial.items():
        if rest:
            yield LogLine(task=task, text=rest)


def _runner_exited(raw: dict[str, Any], workdir: Path) -> dict[str, Any]:
    status = dict(raw.get("status") or {})
    status["state"] = "Failed"
    status["conditions"] = [
        *(status.get("conditions") or []),
        {
            "type": "Failed",
            "status": "True",
            "reason": "LocalRunnerExited",
            "message": f"the jaxps local process of this job is gone before the job ended; "
            f"see {workdir / RUNNER_LOG}: {_tail(workdir / RUNNER_LOG)}",
        },
    ]
    return {**raw, "status": status}


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return loaded


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "jaxps_operator"  # no /proc (macOS): trust the pid
