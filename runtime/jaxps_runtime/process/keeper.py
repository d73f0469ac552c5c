"""A ps pod's first process: it runs the ps as its child and keeps a standby ps beside it, which
takes over at once when the ps is killed (standard library only).

A ps lost on Kubernetes is what the whole job waits for. A new pod takes seconds before its ps
serves (scheduling, the sandbox, the container, importing Python and JAX); a ps process killed
in its pod (the OOM killer, a crash in native code, a SIGKILL) needs none of that when a process
loaded ahead is there to become it: the same pod, the same address, the same credentials.
`JAXPS_PS_STANDBY=on` (the operator sets it on a ps pod unless its template says off) makes
`python -m jaxps_runtime` such a keeper:

- it starts the ps as a child, and `SPARE_DELAY` seconds later a standby (`standby.Standby`:
  JAX and the ps loaded, waiting on its stdin) so that it does not slow the ps's own start;
- when the ps dies of a signal it did not ask for (SIGKILL, SIGSEGV, SIGABRT, ...), the standby
  becomes that ps: it listens on the same port and the chief recovers the job as for any lost
  ps; a new standby is started `SPARE_DELAY` seconds later;
- a ps that exits (done, failed, a usage error, stopped) or a death with no standby ready ends
  the keeper with the ps's exit code (128 + N for signal N), so the pod ends as it would have;
- a ps the kernel killed for memory (the container's cgroup counts an OOM kill) is not taken
  over: the pod's memory limit is too small for it, and a standby would only add to it; the
  keeper ends with 137 and the operator names the limit (OOMKilled) as for any task;
- at most `TAKEOVERS` times per pod: a ps that keeps dying ends the pod then, which the
  operator replaces and counts against the job's restart limits as for any failed pod;
- SIGTERM and SIGINT go to the ps (which stops cleanly); the standby is ended. A keeper killed
  itself takes its pod's processes with it (the container ends).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from jaxps_runtime.config import cluster
from jaxps_runtime.process.standby import RUNTIME, Standby

KEEPER_ENV = "JAXPS_PS_STANDBY"
SPARE_DELAY = 10.0
"""Seconds from a ps's start to its standby's: the standby's load (JAX, on the same cores)
should not slow the ps's start or its recovery. JAXPS_PS_STANDBY_DELAY sets another
(`cluster.seconds_setting`, checked where JAXPS_PS_STANDBY is)."""
TAKEOVERS = 5
"""The most times a standby takes over in one pod; the next death ends the pod."""
MEMORY_EVENTS = (
    Path("/sys/fs/cgroup/memory.events"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.oom_control"),  # cgroup v1
)
"""The container's own memory cgroup as a pod sees it: `oom_kill N` counts its OOM kills."""
_ASKED = frozenset({signal.SIGTERM, signal.SIGINT})
"""Signals a ps is stopped with: its exit then is the pod's, not a loss to take over."""


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether JAXPS_PS_STANDBY (checked by `cluster.setting_problem`) asks for a keeper."""
    return environ.get(KEEPER_ENV, "off").lower() == "on"


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def taken_over(returncode: int) -> bool:
    """Whether a ps that ended with `returncode` was lost (killed by a signal it was not sent to
    stop), which a standby may make good, rather than ended for a reason of its own."""
    return returncode < 0 and -returncode not in _ASKED


def oom_kills(files: Sequence[Path] = MEMORY_EVENTS) -> int | None:
    """The OOM kills in this process's memory cgroup so far, from the first of `files` that
    counts them (None where none does)."""
    for events in files:
        try:
            text = events.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


class Keeper:
    """The ps (`child`) and its standby (`spare`), and what to do when either ends."""

    def __init__(
        self,
        argv: Sequence[str],
        environ: Mapping[str, str],
        *,
        spare_delay: float = SPARE_DELAY,
        takeovers: int = TAKEOVERS,
    ) -> None:
        self.env = {k: v for k, v in environ.items() if k != KEEPER_ENV}
        self.argv = (*RUNTIME, *argv)
        self.spare_delay, self.takeovers_left = spare_delay, takeovers
        self.spare: Standby | None = None
        self.spare_due = time.monotonic() + spare_delay
        self.stopping = threading.Event()
        self.oom_kills = oom_kills()
        self.child = subprocess.Popen(self.argv, env=self.env)

    def stop(self, signum: int, _frame: FrameType | None = None) -> None:
        """SIGTERM or SIGINT: the ps is told the same, the standby ended."""
        self.stopping.set()
        self._close_spare()
        if self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        """Keeps the ps until it ends for good; its exit code."""
        while True:
            try:
                returncode = self.child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                self._spare_when_due()
                continue
            if self.stopping.is_set() or not taken_over(returncode) or not self._take_over():
                self._close_spare()
                self._say(f"ps ended with exit code {exit_code(returncode)}")
                return exit_code(returncode)
            self._say(
                f"ps killed (signal {-returncode}); the standby took over "
                f"({self.takeovers_left} more this pod)"
            )

    def _spare_when_due(self) -> None:
        if self.spare is not None and not self.spare.alive:
            self._say(f"the standby ended (exit code {self.spare.process.returncode})")
            self.spare = None
            self.spare_due = time.monotonic() + self.spare_delay
        if (
            self.spare is None
            and self.takeovers_left > 0
            and not self.stopping.is_set()
            and time.monotonic() >= self.spare_due
        ):
            self.spare = Standby(self.env, log=None, argv=self.argv)

    def _take_over(self) -> bool:
        """The standby becomes the ps; False if there is none that can."""
        spare, self.spare = self.spare, None
        if (now := oom_kills()) is not None and now != self.oom_kills:
            self._say("the ps was killed for memory: no standby takes over in this pod")
            if spare is not None:
                spare.close()
            return False
        if spare is None or self.takeovers_left <= 0:
            return False
        # the pod's own stdout and stderr, which the standby inherited
        taken = spare.take(
            self.env, stdout=Path("/dev/stdout"), stderr=Path("/dev/stderr"), argv=self.argv
        )
        if taken is None:
            spare.close()
            return False
        self.child = taken
        self.takeovers_left -= 1
        self.spare_due = time.monotonic() + self.spare_delay
        return True

    def _close_spare(self) -> None:
        if self.spare is not None:
            self.spare.close()
            self.spare = None

    def _say(self, what: str) -> None:
        print(f"jaxps_runtime: keeper: {what}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    """Runs the ps `python -m jaxps_runtime argv` under a keeper; its exit code."""
    delay = cluster.seconds_setting(environ.get(cluster.PS_STANDBY_DELAY_ENV, str(SPARE_DELAY)))
    keeper = Keeper(argv, environ, spare_delay=SPARE_DELAY if delay is None else delay)
    for signum in _ASKED:
        signal.signal(signum, keeper.stop)
    return keeper.run()
