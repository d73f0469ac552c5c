"""How long a worker's steps take: the pull/compute/push split of a step, the examples per
second, and the span of global steps its warm steps covered, which its heartbeats carry to the
chief (the summary's `stepSeconds` and `stepsPerSecond`). Not thread-safe: one worker's loop
adds, its heartbeat thread reads whole floats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SPAN_KEYS = ("firstStepTime", "firstStep", "lastStepTime", "lastStep")
"""Heartbeat metrics a worker adds to its step split: the wall time and global step at the end
of its first warm step and of its last step (see :func:`overlap_steps_per_second`)."""


@dataclass
class StepTimes:
    """Seconds spent per step in each phase, summed after the first (compiling) step, and the
    span (wall time, global step) the warm steps covered."""

    pull: float = 0.0
    compute: float = 0.0
    push: float = 0.0
    steps: int = 0
    examples: int = 0
    started: float = field(default_factory=time.perf_counter)
    warm: bool = False
    span: list[float] = field(default_factory=list)

    def add(self, *, pull: float, compute: float, push: float, examples: int, step: int) -> None:
        now = time.time()
        if not self.warm:  # the first step compiles: leave it out
            self.warm = True
            self.started = time.perf_counter()
            self.span = [now, step, now, step]
            return
        self.pull += pull
        self.compute += compute
        self.push += push
        self.steps += 1
        self.examples += examples
        self.span[2:] = [now, step]

    def means(self) -> dict[str, float]:
        """The mean split of a step (seconds) and, once warm, the span (SPAN_KEYS)."""
        n = max(self.steps, 1)
        split = {"pull": self.pull / n, "compute": self.compute / n, "push": self.push / n}
        return {**split, **dict(zip(SPAN_KEYS, self.span, strict=False))}

    def examples_per_second(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.examples / elapsed if elapsed > 0 else 0.0


def overlap_steps_per_second(spans: list[tuple[float, float, float, float]]) -> float:
    """Global steps per second while every worker trained, from each worker's span (first warm
    step's wall time and global step, last step's wall time and global step).

    A worker that starts late (TensorFlow's non-chief sleeps 30 s when it finds the chief not
    ready yet) would otherwise count the others' solo steps as if they ran side by side. With
    no common window (one worker finished before another began) it is the whole span's rate.
    """
    if not spans:
        return 0.0
    start = max(spans, key=lambda s: s[0])
    end = min(spans, key=lambda s: s[2])
    t0, step0, t1, step1 = start[0], start[1], end[2], end[3]
    if t1 <= t0 or step1 <= step0:
        t0, step0 = min((s[0], s[1]) for s in spans)
        t1, step1 = max((s[2], s[3]) for s in spans)
    return (step1 - step0) / (t1 - t0) if t1 > t0 else 0.0
