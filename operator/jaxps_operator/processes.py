"""Processes on this machine: the one way jaxps starts, stops and reaps them.

`jaxps local` (`local.LocalCluster`, a kubelet of one job) runs its pods with it, and so does
the harness the process tests and the benchmarks start bare tasks with (tests/process/harness).
Tasks are started with subprocess, never forked, because gRPC and JAX must not be forked once
imported. A task's environment is what a node gives a container (`node_env`); its output is
appended to files; stdin is closed. Stopping asks politely (SIGTERM), waits, then kills
(SIGKILL): nothing started here outlives `stop`. A ps can start from the job's standby, a ps
process loaded ahead (`jaxps_runtime.process.standby`), when one fits.

Not thread-safe: one loop drives a `Processes`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jaxps_runtime.process.standby import RUNTIME, Standby, runs_the_runtime

GRACE_SECONDS = 10.0  # from SIGTERM to SIGKILL, as a pod's terminationGracePeriodSeconds
RUNTIME_ROOT = Path(__file__).resolve().parents[2] / "runtime"  # a source checkout's runtime


def node_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a container's environment is on this machine: this process's own, then `env`,
    JAX on the CPU unless `env` says otherwise, and the runtime first on PYTHONPATH (a source
    checkout runs without installing it)."""
    out = {**os.environ, **(env or {})}
    out.setdefault("JAX_PLATFORMS", "cpu")
    paths = [str(RUNTIME_ROOT), *filter(None, out.get("PYTHONPATH", "").split(os.pathsep))]
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return out


def start(
    argv: Sequence[str], *, env: Mapping[str, str], stdout: Path | None, stderr: Path | None = None
) -> subprocess.Popen[bytes]:
    """A new process running `argv`; stdout appended to `stdout` (None: discarded), stderr to
    `stderr` (None: with stdout)."""
    with open(stdout or os.devnull, "ab") as out:
        if stderr is None:
            return subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        with open(stderr, "ab") as err:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)


def exit_code(popen: subprocess.Popen[bytes]) -> int | None:
    """The exit code as Kubernetes reports it (death by signal N is 128 + N); None while the
    process runs."""
    code = popen.poll()
    if code is None:
        return None
    return 128 - code if code < 0 else code


def stop(
    popens: Iterable[subprocess.Popen[bytes]], *, grace: float = GRACE_SECONDS
) -> list[int | None]:
    """SIGTERM to every process still running, then SIGKILL to those still running after
    `grace` seconds; every one is reaped. Their return codes (-N: killed by signal N)."""
    popens = list(popens)
    for popen in popens:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for popen in popens:
        try:
            popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
    return [popen.returncode for popen in popens]


@dataclass
class Processes:
    """The processes of one job, by task name, and its standby ps.

    With `standby_log`, a job keeps one standby ps (logging there): a ps task that fits becomes
    it instead of a new process, and whenever there is none (at the first ps, after one was
    taken or died) another is loaded from the started ps's environment. `stop_all` ends every
    process and the standby.
    """

    standby_log: Path | None = None  # None: no standby, every ps starts as a new process
    popens: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    standby: Standby | None = None

    def start(
        self,
        name: str,
        *,
        env: Mapping[str, str],
        argv: Sequence[str] = RUNTIME,
        stdout: Path | None,
        stderr: Path | None = None,
        ps: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Starts task `name` (again, once its last process exited), from the standby when it
        is a ps (`ps`) that fits; output as `start` does."""
        popen = None
        if ps and self.standby is not None:
            out = stdout or Path(os.devnull)
            popen = self.standby.take(env, stdout=out, stderr=stderr or out, argv=argv)
            if popen is not None or not self.standby.alive:  # taken, or dead: another one
                self.standby = None
        if popen is None:
            popen = start(argv, env=env, stdout=stdout, stderr=stderr)
        if ps and self.standby is None and self.standby_log is not None and runs_the_runtime(argv):
            self.standby = Standby(env, log=self.standby_log, argv=argv)  # for the next ps
        self.popens[name] = popen
        return popen

    def close_standby(self) -> None:
        """Ends the standby (no ps will be replaced any more)."""
        if self.standby is not None:
            self.standby.close()
            self.standby = None

    def stop_all(
        self, *, grace: float = GRACE_SECONDS, last: Collection[str] = ()
    ) -> list[int | None]:
        """Ends the standby and every process (`stop`); their return codes. Those named in
        `last` (the ps) are stopped once the others have ended: a chief told to stop writes
        its preemption checkpoint, which needs every ps still serving."""
        self.close_standby()
        first = [p for name, p in self.popens.items() if name not in last]
        then = [p for name, p in self.popens.items() if name in last]
        return stop(first, grace=grace) + stop(then, grace=grace)
