"""A ps started ahead: loaded, waiting to become a ps that died (standard library only).

A restarted ps is what a whole job waits for, and most of its start is importing JAX (0.5-0.6 s
of ~1 s on 2 cores). The local launcher (`jaxps_operator.processes`, under `jaxps local` and
the tests' harness) keeps one standby per job: `python -m jaxps_runtime` with JAXPS_STANDBY=ps,
which loads what a ps loads and then reads one JSON line on stdin, the task it becomes
(`assignment`). Its environment is the job's; the assignment may set only what differs between
two ps of one job (TASK_ENV), since what JAX and the ps read as they load (XLA_FLAGS, the
compilation cache) came from the standby's own. A replaced pod on Kubernetes starts cold: its
pod is new.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STANDBY_ENV = "JAXPS_STANDBY"
TASK_ENV = frozenset({"TF_CONFIG", "JAXPS_METRICS_PORT", "JAXPS_TLS_DIR", "JAXPS_TERMINATION_LOG"})
"""What may differ between two ps tasks of one job: a standby takes these from its task."""


class StandbyError(ValueError):
    """A standby was told to become a task it cannot be."""


def assignment(line: str) -> dict[str, Any]:
    """The task a standby becomes, checked: a JSON object with env (only TASK_ENV keys, string
    values), stdout and stderr (paths)."""
    try:
        raw = json.loads(line)
    except ValueError as err:
        raise StandbyError(f"the assignment is not JSON: {err}") from None
    if not isinstance(raw, dict) or set(raw) != {"env", "stdout", "stderr"}:
        raise StandbyError("the assignment must be an object with env, stdout and stderr")
    env = raw["env"]
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise StandbyError("env: expected an object of strings")
    if extra := sorted(set(env) - TASK_ENV):
        raise StandbyError(
            f"env: got {', '.join(extra)}; a standby takes only {', '.join(sorted(TASK_ENV))}"
        )
    for key in ("stdout", "stderr"):
        if not isinstance(raw[key], str) or not raw[key]:
            raise StandbyError(f"{key}: expected a file path")
    return raw


RUNTIME = (sys.executable, "-m", "jaxps_runtime")


def runs_the_runtime(argv: Sequence[str]) -> bool:
    """Whether a task's command is this interpreter's jaxps runtime, which a standby is (not a
    command of the user's own, which it must never start ahead of time)."""
    return tuple(argv[:3]) == RUNTIME


class Standby:
    """A ps process started ahead, loaded and waiting to become a ps that died (see
    `jaxps_runtime.__main__.standby`): a restarted ps then skips importing JAX, most of its
    start. `take` hands it a task; `close` ends it if it was never taken (no process is left)."""

    def __init__(
        self, env: Mapping[str, str], *, log: Path | None, argv: Sequence[str] = ()
    ) -> None:
        """Starts it with `env` and `argv`; its stderr to `log` (None: this process's stdout
        and stderr, which a task it becomes may name as /dev/stdout and /dev/stderr)."""
        self.env = {k: v for k, v in env.items() if k not in TASK_ENV}
        self.argv = tuple(argv) or RUNTIME
        if not runs_the_runtime(self.argv):
            raise ValueError(f"a standby runs {' '.join(RUNTIME)}, not {' '.join(self.argv)}")
        with contextlib.ExitStack() as files:
            err = files.enter_context(open(log, "ab")) if log is not None else None
            self.process: subprocess.Popen[bytes] = subprocess.Popen(
                self.argv,
                env={**self.env, STANDBY_ENV: "ps"},
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL if log is not None else None,
                stderr=err,
            )

    @property
    def alive(self) -> bool:
        """Still there (a standby may die, say killed for memory, before it is taken)."""
        return self.process.poll() is None

    def fits(self, env: Mapping[str, str], argv: Sequence[str] = ()) -> bool:
        """Whether a task with `env` and `argv` can be this standby: alive, and started with
        the same command and environment but for what differs between two ps (TASK_ENV)."""
        rest = {k: v for k, v in env.items() if k not in TASK_ENV}
        same_argv = (tuple(argv) or RUNTIME) == self.argv
        return self.alive and rest == self.env and same_argv

    def take(
        self, env: Mapping[str, str], *, stdout: Path, stderr: Path, argv: Sequence[str] = ()
    ) -> subprocess.Popen[bytes] | None:
        """The standby, now running as the task `env` and `argv` describe; None when it
        cannot be (then start the task as a new process)."""
        if not self.fits(env, argv):
            return None
        task = {k: v for k, v in env.items() if k in TASK_ENV}
        line = json.dumps({"env": task, "stdout": str(stdout), "stderr": str(stderr)}) + "\n"
        stdin = self.process.stdin
        assert stdin is not None
        try:
            stdin.write(line.encode())
            stdin.close()
        except OSError:  # it died just now
            return None
        return self.process

    def close(self, *, timeout: float = 5.0) -> None:
        """Ends a standby never taken (it may still be loading): SIGTERM, then SIGKILL after
        `timeout`. A taken one is its task's process now, and left alone."""
        stdin = self.process.stdin
        if stdin is None or stdin.closed:
            return
        with contextlib.suppress(OSError):
            stdin.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
