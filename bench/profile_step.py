"""Where a worker step's time goes on a bandwidth-bound model: CPU time and page faults per step
of the worker and the ps, and (with `--py-spy`) py-spy profiles of both.

Starts a 1 ps + 1 worker async job training a dense mlp (hidden [2048, 2048]: 4.3M parameters,
17 MB each way per step) on digits, lets the worker warm up, then samples the worker and the ps
with py-spy for `--seconds` (all threads, native frames off) and prints, per process, the
functions holding the most samples, by self time and by total time (collapsed stacks, as
`py-spy record --format raw` writes them, are kept under --out). Without `--py-spy` it only
watches the same window. Either way it prints, per process, the CPU time (user + system) and
the minor page faults per global step over the window (from /proc).

    python bench/profile_step.py [--py-spy PATH] [--seconds 10] [--out DIR] [--hidden 64] [--gil]

`--hidden` sets the mlp's hidden layers (default 2048 2048; `--hidden 64` is the latency-bound
`mlp-async` case of bench/vs_tensorflow.py); `--gil` samples only the thread holding Python's
GIL, which shows where the Python time goes rather than where threads wait.

py-spy is not a jaxps dependency: `pip download py-spy` and unpack the wheel, or install it.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))

from recovery import global_step

from jaxps_runtime import launch

TRAINING = {
    "model": {"name": "mlp", "kwargs": {"hidden": [2048, 2048]}},
    "dataset": {"name": "digits"},
    "mode": "async",
    "steps": 100_000,
    "batchSize": 64,
    "optimizer": {"name": "adagrad", "kwargs": {"learning_rate": 0.01}},
    "logEverySeconds": 30,
}


def usage(pid: int) -> tuple[float, int]:
    """A process's CPU seconds (user + system) and minor page faults so far (/proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, int(fields[7])


def summarize(raw: Path, top: int) -> str:
    """The functions with the most samples, by self time and by total time."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        samples += n
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    idle = ("wait (threading.py", "_wait_once", "sleep", "select", "poll", "epoll")
    lines = [f"{samples} samples"]
    for title, counter in (("self", own), ("total", total)):
        lines.append(f"  by {title} time:")
        shown = 0
        for frame, n in counter.most_common():
            if any(word in frame for word in idle):
                continue
            lines.append(f"    {100 * n / samples:5.1f}%  {frame}")
            shown += 1
            if shown == top:
                break
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy", help="the py-spy executable (without: no profiles)")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, help="keep the collapsed stacks here")
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 2048])
    parser.add_argument("--gil", action="store_true", help="only the thread holding the GIL")
    args = parser.parse_args()
    training = {**TRAINING, "model": {"name": "mlp", "kwargs": {"hidden": args.hidden}}}
    with tempfile.TemporaryDirectory(prefix="jaxps-profile-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        job = launch.LocalJob.start(training=training, log_dir=Path(tmp) / "logs", ps=1, workers=1)
        try:
            deadline = time.monotonic() + 300
            while (global_step(job, "worker-0") or 0) < 50:
                if time.monotonic() > deadline:
                    raise TimeoutError(job.logs())
                time.sleep(0.2)
            first = global_step(job, "worker-0") or 0
            names = ("worker-0", "ps-0")
            before = {name: usage(job.processes[name].pid) for name in names}
            started = time.monotonic()
            records = {
                name: subprocess.Popen(
                    [
                        args.py_spy,
                        "record",
                        "--pid",
                        str(job.processes[name].pid),
                        "--duration",
                        str(args.seconds),
                        "--rate",
                        "200",
                        "--threads",
                        "--format",
                        "raw",
                        "--output",
                        str(out / f"{name}.txt"),
                        "--nonblocking",
                        *(["--gil"] if args.gil else []),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for name in (names if args.py_spy else ())
            }
            for proc in records.values():
                proc.wait(timeout=args.seconds + 120)
            if not records:
                time.sleep(args.seconds)
            steps = (global_step(job, "worker-0") or 0) - first
            after = {name: usage(job.processes[name].pid) for name in names}
            elapsed = time.monotonic() - started
            print(f"{steps} steps in {elapsed:.1f} s: {steps / elapsed:.1f} steps/s while sampled")
            for name in names:
                cpu, faults = (a - b for a, b in zip(after[name], before[name], strict=True))
                print(
                    f"{name}: {1e3 * cpu / max(steps, 1):.1f} ms CPU and "
                    f"{faults / max(steps, 1):.0f} minor page faults per step"
                )
            for name in records:
                print(f"\n{name}: {summarize(out / f'{name}.txt', args.top)}")
        finally:
            job.stop()


if __name__ == "__main__":
    main()
