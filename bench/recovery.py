"""Recovery: from SIGKILL of a ps (started again at once) to the global step advancing again.

Prints one JSON object per measurement (DEVELOPERS.md format). An `mlp` job (2 ps + 2
workers, a checkpoint every 50 steps; sync unless `--mode` says otherwise) has ps-0 killed
several times; each time the script starts it again at once and watches worker-1's
`jaxps_global_step` (updated every pull) for the rollback to the checkpoint and the first step
after it. Baseline, measured in the same run: a cold start of the whole job until its first
step, which is what recovery costs when every task restarts from the checkpoint (TensorFlow's
way). `ratio` = baseline / jaxps (above 1: jaxps recovers faster). Target (issue 17): a median
under 1 s in every mode.

ps-0 is started again as `jaxps local` and the tests' `LocalJob` do (`jaxps_operator.processes`):
by default it becomes the job's standby, a ps process started ahead that has loaded JAX; with
`--cold` it is a new process that imports everything first, as a replaced pod does (`...-cold`).

    python bench/recovery.py [--kills 3] [--mode sync|async|boundedStaleness] [--cold]

With `--kubernetes` it measures on the real node instead (root; it starts the e2e tier's node,
chart and job: tests/e2e/recovery_bench.py): ps-0's ps process SIGKILLed in its pod, where the
pod's keeper holds a standby that takes over (`jaxps_runtime.process.keeper`), `--kills` times
(at most 5, the keeper's takeovers per pod), against the pod's container killed (a new pod).

    python bench/recovery.py --kubernetes [--kills 5]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.process.harness

import results

from jaxps_runtime.config import training as config
from tests.process import harness

EVERY = 50
TRAINING = {
    "model": {"name": "mlp"},
    "mode": "sync",
    "steps": 100_000,
    "batchSize": 32,
    "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    "checkpoint": {"everySteps": EVERY, "keep": 2},
    "heartbeatSeconds": 0.25,
    "workerTimeoutSeconds": 5,
    "logEverySeconds": 5,
}


def global_step(job: harness.LocalJob, task: str = "worker-1") -> int | None:
    try:
        port = job.metrics_ports[task]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("jaxps_global_step{"):
                    return int(float(line.rsplit(" ", 1)[1]))
    except OSError:
        pass
    return None


def wait_step(job: harness.LocalJob, at_least: int, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while (global_step(job) or 0) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {at_least} not reached\n{job.logs()}")
        time.sleep(0.01)
    return time.monotonic()


def on_the_node(*, kills: int) -> int:
    """tests/e2e/recovery_bench.py on the e2e tier's node (`results.on_the_node`)."""
    return results.on_the_node("recovery_bench.py", {"JAXPS_BENCH_KILLS": str(kills)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kills", type=int, default=None, help="default 3; 5 with --kubernetes (1 to 5 there)"
    )
    parser.add_argument("--mode", choices=config.MODES, default="sync")
    parser.add_argument("--cold", action="store_true", help="no standby: a new process")
    parser.add_argument(
        "--kubernetes", action="store_true", help="on the real node: the ps process in its pod"
    )
    args = parser.parse_args()
    if args.kubernetes:
        kills = 5 if args.kills is None else args.kills
        if not 1 <= kills <= 5:
            parser.error(f"--kills: got {kills}; on the node 1 to 5 (a keeper's takeovers per pod)")
        sys.exit(on_the_node(kills=kills))
    args.kills = 3 if args.kills is None else args.kills
    case = f"mlp-2ps-2w-{args.mode}-kill-ps0{'-cold' if args.cold else ''}"
    with tempfile.TemporaryDirectory(prefix="jaxps-recovery-") as tmp:
        training = {
            **TRAINING,
            "mode": args.mode,
            "checkpoint": {**TRAINING["checkpoint"], "dir": f"{tmp}/ckpt"},
        }
        started = time.monotonic()
        job = harness.LocalJob.start(
            training=training, log_dir=Path(tmp) / "logs", standby=not args.cold
        )
        try:
            cold = wait_step(job, 1) - started
            seconds, lost = [], []
            for k in range(args.kills):
                wait_step(job, (k + 1) * 4 * EVERY + EVERY // 2)
                killed_at = global_step(job) or 0
                killed = time.monotonic()
                job.processes["ps-0"].send_signal(signal.SIGKILL)
                job.processes["ps-0"].wait()
                job.start_task("ps-0", metrics_port=job.metrics_ports["ps-0"])
                lowest = killed_at
                while True:  # the rollback shows as a lower step, then the step moves on
                    step = global_step(job)
                    if step is not None and step < lowest:
                        lowest = step
                    elif step is not None and lowest < killed_at and step > lowest:
                        break
                    if time.monotonic() - killed > 120:
                        raise TimeoutError(f"no recovery after 120 s\n{job.logs()}")
                    time.sleep(0.01)
                seconds.append(time.monotonic() - killed)
                lost.append(killed_at - lowest)
        finally:
            job.stop()
    results.emit(
        "recovery",
        case,
        metric="seconds_to_next_step",
        value=statistics.median(seconds),
        unit="s",
        baseline="cold-restart-of-the-job",
        baseline_value=cold,
        lower_is_better=True,
    )
    for i, (s, n) in enumerate(zip(seconds, lost, strict=True)):
        results.emit(
            "recovery",
            f"{case}-{i}",
            metric="seconds_to_next_step",
            value=s,
            unit="s",
            baseline="cold-restart-of-the-job",
            baseline_value=cold,
            lower_is_better=True,
        )
        results.emit(
            "recovery",
            f"{case}-{i}",
            metric="steps_lost",
            value=n,
            unit="steps",
            baseline="checkpoint-interval",
            baseline_value=EVERY,
            lower_is_better=True,
        )


if __name__ == "__main__":
    main()
