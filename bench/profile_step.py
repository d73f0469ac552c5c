"""Where a worker step's time goes on a bandwidth-bound model: CPU time and page faults per step
of the worker and the ps, py-spy profiles of both (`--py-spy`) and a native profile of the whole
machine by library (`--perf`).

Starts a job training a dense mlp (hidden [2048, 2048]: 4.3M parameters, 17 MB each way per
step) on digits, 1 ps + 1 worker async unless told otherwise (`--ps 2 --workers 2 --mode sync`
is the `dense-sync` case of bench/vs_tensorflow.py), lets it warm up, then watches it for
`--seconds`. It prints, per process, the CPU time (user + system) and the minor page faults per
global step over the window (from /proc). With `--py-spy` it samples worker-0 and ps-0 (all
threads, native frames off) and prints the functions holding the most samples, by self time and
by total time (collapsed stacks, as `py-spy record --format raw` writes them, are kept under
--out). With `--perf` it samples every CPU with `perf record -a` (only this job should run) and
prints the share of all samples per kind of work (memory copies, the kernel's socket copies and
the rest of the kernel, the Python interpreter, grpc, XLA's kernels, ...) and the hottest native
symbols: unlike py-spy it sees time spent outside Python and outside the GIL.

    python bench/profile_step.py [--py-spy PATH] [--perf PATH] [--seconds 10] [--out DIR]
        [--hidden 64] [--gil] [--ps 2] [--workers 2] [--mode sync] [--tls]

`--hidden` sets the mlp's hidden layers (default 2048 2048; `--hidden 64` is the latency-bound
`mlp-async` case of bench/vs_tensorflow.py); `--gil` samples only the thread holding Python's
GIL, which shows where the Python time goes rather than where threads wait.

py-spy is not a jaxps dependency: `pip download py-spy` and unpack the wheel, or install it.
perf comes with Debian's `linux-perf`.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.process.harness

from recovery import global_step

from tests.process import harness

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


# Kinds of work in a native profile, by shared object and symbol (first match wins).
KINDS: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("memory copies (libc memcpy/memmove)", lambda dso, sym: "libc" in dso and "mem" in sym),
    ("kernel: socket copies", lambda dso, sym: "kernel" in dso and "copy_" in sym),
    ("kernel: the rest (scheduling, syscalls, TCP)", lambda dso, sym: "kernel" in dso),
    ("malloc and free", lambda dso, sym: "libc" in dso and ("alloc" in sym or "free" in sym)),
    ("Python interpreter", lambda dso, sym: "libpython" in dso),
    ("grpc (cygrpc)", lambda dso, sym: "cygrpc" in dso),
    ("XLA: compiled kernels and runtime", lambda dso, sym: "jax" in dso or "JIT" in dso),
    ("numpy", lambda dso, sym: "multiarray" in dso),
    ("protobuf", lambda dso, sym: "_message" in dso or "protobuf" in dso),
)


def native_profile(perf: str, data: Path, top: int) -> str:
    """Shares of all samples per kind of work, then the hottest symbols (perf report)."""
    report = subprocess.run(
        [perf, "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows: list[tuple[float, str, str]] = []
    for line in report.splitlines():
        parts = line.split()
        if len(parts) < 4 or line.lstrip().startswith("#") or not parts[0].endswith("%"):
            continue
        # "  16.51%  libc.so.6  [.] __memmove_avx512_unaligned_erms" ([JIT] tid N: two words)
        at = parts.index("[.]") if "[.]" in parts else parts.index("[k]") if "[k]" in parts else 2
        rows.append((float(parts[0].rstrip("%")), " ".join(parts[1:at]), " ".join(parts[at + 1 :])))
    shares: collections.Counter[str] = collections.Counter()
    for share, dso, sym in rows:
        kind = next((name for name, match in KINDS if match(dso, sym)), "other")
        shares[kind] += share
    lines = ["share of all CPU samples by kind of work:"]
    lines += [f"  {share:5.1f}%  {kind}" for kind, share in shares.most_common()]
    lines.append("hottest symbols:")
    lines += [f"  {share:5.1f}%  {sym[:90]} ({dso})" for share, dso, sym in rows[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy", help="the py-spy executable (without: no profiles)")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, help="keep the collapsed stacks here")
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048, 2048])
    parser.add_argument("--gil", action="store_true", help="only the thread holding the GIL")
    parser.add_argument("--perf", help="the perf executable (without: no native profile)")
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--mode", choices=("async", "sync"), default="async")
    parser.add_argument("--tls", action="store_true", help="mutual TLS, as users run jobs")
    args = parser.parse_args()
    training = {
        **TRAINING,
        "model": {"name": "mlp", "kwargs": {"hidden": args.hidden}},
        "mode": args.mode,
    }
    with tempfile.TemporaryDirectory(prefix="jaxps-profile-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        job = harness.LocalJob.start(
            training=training,
            log_dir=Path(tmp) / "logs",
            ps=args.ps,
            workers=args.workers,
            tls=args.tls,
        )
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
            if args.perf:
                records["perf"] = subprocess.Popen(
                    [
                        args.perf,
                        "record",
                        "-F",
                        "999",
                        "-a",
                        "-o",
                        str(out / "perf.data"),
                        "--",
                        "sleep",
                        str(args.seconds),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
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
                if name == "perf":
                    print(f"\nall CPUs: {native_profile(args.perf, out / 'perf.data', args.top)}")
                else:
                    print(f"\n{name}: {summarize(out / f'{name}.txt', args.top)}")
        finally:
            job.stop()


if __name__ == "__main__":
    main()
