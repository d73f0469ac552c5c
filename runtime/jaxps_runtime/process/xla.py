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

Standard library only at import (a ps imports this before JAX).
"""

from __future__ import annotations

import contextlib
import os


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
