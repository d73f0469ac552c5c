"""Where a worker step's time goes on a bandwidth-bound model: py-spy on the worker and the ps.

Starts a 1 ps + 1 worker async job training a dense mlp (hidden [2048, 2048]: 4.3M parameters,
17 MB each way per step) on digits, lets the worker warm up, then samples the worker and the ps
with py-spy for `--seconds` (all threads, native frames off) and prints, per process, the
functions holding the most samples, by self time and by total time (collapsed stacks, as
`py-spy record --format raw` writes them, are kept under --out).

    python bench/profile_step.py --py-spy PATH [--seconds 10] [--out DIR] [--hidden 64] [--gil]

`--hidden` sets the mlp's hidden layers (default 2048 2048; `--hidden 64` is the latency-bound
`mlp-async` case of bench/vs_tensorflow.py); `--gil` samples only the thread holding Python's
GIL, which shows where the Python time goes rather than where threads wait.

py-spy is not a jaxps dependency: `pip download py-spy` and unpack the wheel, or install it.
"""

from __future__ import annotations

import argparse
import collections
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
    parser.add_argument("--py-spy", required=True, help="the py-spy executable")
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
                for name in ("worker-0", "ps-0")
            }
            for proc in records.values():
                proc.wait(timeout=args.seconds + 120)
            steps = (global_step(job, "worker-0") or 0) - first
            elapsed = time.monotonic() - started
            print(f"{steps} steps in {elapsed:.1f} s: {steps / elapsed:.1f} steps/s while sampled")
            for name in records:
                print(f"\n{name}: {summarize(out / f'{name}.txt', args.top)}")
        finally:
            job.stop()


if __name__ == "__main__":
    main()
