"""XLA's CPU backend started with a given number of intra-op threads.

XLA sizes its intra-op thread pool once, when its CPU backend starts, from the CPUs the
starting thread may run on (tsl's `NumSchedulableCPUs`: the thread's affinity), and has no
flag for the count: `--xla_cpu_multi_thread_eigen=false` no longer keeps its work on one thread
(jax 0.10 on 2 cores still starts two pool threads and splits a ps's update across them:
8.9 ms of CPU per update of a 2.1M-parameter Adagrad shard instead of 6.7 on one). The way
JAX's maintainers give (jax-ml/jax#1539) is the affinity: `start_cpu_backend` narrows the
calling thread's to `threads` CPUs while the backend starts, then gives it, and every thread
started meanwhile (the pool's), the whole set back, so the pool has `threads` threads that the
kernel still schedules on any CPU.

XLA counts the CPUs a process may run on, not those its container may use: a pod limited to
2 CPUs on a 64-core node gets 64 pool threads, which the kernel's CPU quota then throttles
(jax-ml/jax#27028). `cpu_limit` reads that quota, as Go's automaxprocs does for GOMAXPROCS.

Standard library only at import (a ps imports this before JAX).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path


def start_cpu_backend(threads: int) -> None:
    """Starts JAX's CPU backend (`jax.devices()`) with an intra-op pool of `threads` threads,
    or of every CPU this process may use when that is fewer. A backend already started is
    left as it is."""
    import jax  # noqa: PLC0415

    allowed = os.sched_getaffinity(0)
    if threads >= len(allowed):
        jax.devices()
        return
    before = _threads()
    os.sched_setaffinity(0, sorted(allowed)[:threads])  # 0: the calling thread
    try:
        jax.devices()
    finally:
        os.sched_setaffinity(0, allowed)
        for tid in _threads() - before:
            with contextlib.suppress(OSError):  # the thread has ended meanwhile
                os.sched_setaffinity(tid, allowed)


def _threads() -> set[int]:
    """This process's threads (Linux: /proc/self/task)."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def cpu_limit(
    *, cgroups: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """The CPUs this process's cgroup, or one above it, may use, rounded up (a pod's
    `limits.cpu`): cgroup v2's cpu.max, v1's cpu.cfs_quota_us over cpu.cfs_period_us; None
    without a limit, or where none can be read. A container sees its own cgroup at `root`
    whatever path /proc names (v1 without a cgroup namespace), so `root` itself is read too."""
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # cgroup v2, one hierarchy
            for directory in _upward(root, path):
                limits += _limit_v2(directory / "cpu.max")
        elif "cpu" in controllers.split(","):
            for directory in _upward(root / controllers, path):
                limits += _limit_v1(directory)
    return min(limits, default=None)


def _upward(base: Path, path: str) -> list[Path]:
    """`base`/`path` and each directory above it up to `base`, those that exist."""
    directory = base / path.lstrip("/")
    found = []
    while True:
        if directory.is_dir():
            found.append(directory)
        if directory == base or base not in directory.parents:
            break
        directory = directory.parent
    return found


def _limit_v2(cpu_max: Path) -> list[int]:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return [] if quota == "max" else _cpus(int(quota), int(period))
    except (OSError, ValueError):
        return []


def _limit_v1(directory: Path) -> list[int]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    return _cpus(quota, period)


def _cpus(quota: int, period: int) -> list[int]:
    """The CPUs a quota of `quota` per `period` (microseconds) gives, rounded up; none for
    no quota (v1 writes -1) or a period that means nothing."""
    return [max(1, math.ceil(quota / period))] if quota > 0 and period > 0 else []
