"""The `jaxps` command: validate a TrainingJob, or run it on this machine.

jaxps validate FILE...                 exit 0 if every manifest is valid, 2 otherwise
jaxps local FILE [--workdir DIR] [--json] [--kill TASK@step=N ...] [--scale worker=N@step=S ...]
                                       exit 0 Succeeded, 1 Failed, 2 invalid manifest
jaxps operator [--namespace NS ...]    the Kubernetes operator, until SIGTERM
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from jaxps_operator import builders, local, schema, terminal_chart

EXIT_SUCCEEDED, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130


def _load(path: Path, console: Console) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except OSError as err:
        console.print(
            f"[red]{escape(str(path))}: cannot read it: {escape(str(err.strerror))}[/red]"
        )
        return None
    try:
        return schema.load(text)
    except schema.InvalidManifestError as err:
        console.print(
            f"[red]{escape(str(path))}: invalid TrainingJob ({len(err.problems)} "
            f"problem{'s' if len(err.problems) > 1 else ''}):[/red]",
            highlight=False,
        )
        for problem in err.problems:
            console.print(f"  {problem}", highlight=False, markup=False)
        return None


def validate(args: argparse.Namespace) -> int:
    console = _console()
    ok = True
    for path in args.files:
        job = _load(path, console)
        if job is None:
            ok = False
        else:
            print(f"{path}: valid TrainingJob {job['metadata']['name']}")
    return EXIT_SUCCEEDED if ok else EXIT_INVALID


def _console() -> Console:
    """stderr, for people; never wrapped when it is not a terminal (a log, a pipe), so a
    field's path stays on the line of its value."""
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, soft_wrap=True, width=10_000)
    return console


def progress_line(job: dict[str, Any], *, rate: float | None = None) -> str:
    """`step 120/600 (20%)  loss 0.4312  35.2 steps/s  ETA 14s  eval accuracy 0.9512`: each
    part only once there is a number for it (no loss before the first step, none that is not
    finite). `rate`: the recent steps per second (`RecentRate`), which the rate and the ETA
    prefer, while the step moves, to status.progress.stepsPerSecond, a mean the chief
    publishes only now and then (and 0 before its first log line)."""
    progress = (job.get("status") or {}).get("progress") or {}
    steps = int(job["spec"]["training"]["steps"])
    step = int(progress.get("step") or 0)
    parts = [f"step {step}/{steps} ({min(100 * step // max(steps, 1), 100)}%)"]
    loss = _number(progress.get("loss"))
    if loss is not None and step > 0:
        parts.append(f"loss {loss:.4f}")
    # the recent rate, 0 too while the step stands still: the chief's mean would show a
    # speed and an ETA that do not move
    speed = rate if rate is not None else _number(progress.get("stepsPerSecond"))
    if speed is not None and (speed > 0 or rate is not None):
        parts.append(f"{speed:.1f} steps/s")
        if speed > 0 and step < steps:
            parts.append(f"ETA {_duration((steps - step) / speed)}")
    evals = {k: v for k, v in (progress.get("eval") or {}).items() if _number(v) is not None}
    if evals:
        metric = "accuracy" if "accuracy" in evals else sorted(evals)[0]
        parts.append(f"eval {metric} {evals[metric]:.4f}")
    return "  ".join(parts)


def _number(value: Any) -> float | None:
    """A finite number, else None (absent, null, NaN, a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _duration(seconds: float) -> str:
    """`14s`, `3m05s`, `2h07m`."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


@dataclass
class RecentRate:
    """Global steps per second over the last `window` seconds of (time, step) samples: what
    the job does now, not its mean since the start. A step that goes back (a rollback to a
    checkpoint) starts the window again. Not thread-safe: the run loop's tick feeds it."""

    window: float = 10.0
    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def observe(self, at: float, step: int) -> None:
        if self.samples and step < self.samples[-1][1]:
            self.samples.clear()
        self.samples.append((at, step))
        while len(self.samples) > 2 and at - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def per_second(self) -> float | None:
        """None until the samples span a second."""
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= 1.0 else None


def _table(
    job: dict[str, Any], runner: local.LocalCluster, *, started: float, rate: float | None
) -> Table:
    status = job.get("status") or {}
    table = Table(
        title=(
            f"TrainingJob {job['metadata']['name']}  [bold]{status.get('state', '?')}[/bold]  "
            f"{escape(progress_line(job, rate=rate))}  restarts {status.get('restarts', 0)}  "
            f"{time.monotonic() - started:.0f} s"
        ),
        title_justify="left",
    )
    for column in ("task", "state", "restarts", "log"):
        table.add_column(column)
    restarts = status.get("replicaStatuses") or {}
    tasks = builders.tasks(job)
    # the workers that leave in a scale-down, until their process is gone
    tasks += sorted(
        (p.role, p.index) for p in runner.processes.values() if (p.role, p.index) not in tasks
    )
    for role, index in tasks:
        name = builders.pod_name(job, role, index)
        proc = runner.processes.get(name)
        if proc is None:
            state = "starting"
        elif proc.deleting_since is not None:
            state = "stopping" if (role, index) in builders.tasks(job) else "leaving"
        elif proc.exit_code is None:
            state = "running"
        else:
            state = f"exited {proc.exit_code}"
        table.add_row(
            name,
            state,
            str(restarts.get(role, {}).get("restarts", 0)),
            escape(str(runner.workdir / f"{name}.log")),
        )
    return table


def run_local(args: argparse.Namespace) -> int:
    console = _console()
    job = _load(args.file, console)
    if job is None:
        return EXIT_INVALID
    tasks = [builders.pod_name(job, r, i) for r, i in builders.tasks(job)]
    try:
        kills = [local.Kill.parse(k, job=job) for k in args.kill]
        scales = [local.Scale.parse(s, job=job) for s in args.scale]
    except (local.KillSpecError, local.ScaleSpecError) as err:
        console.print(str(err), style="red", highlight=False, markup=False)
        return EXIT_INVALID
    try:
        workdir = (
            local.usable_workdir(args.workdir)
            if args.workdir is not None
            else local.default_workdir(job["metadata"]["name"], root=Path(".work"))
        )
    except local.WorkdirError as err:
        console.print(str(err), style="red", highlight=False, markup=False)
        return EXIT_INVALID
    console.print(
        f"running TrainingJob {job['metadata']['name']}: {', '.join(tasks)}; logs in {workdir}",
        highlight=False,
        markup=False,
    )
    board = local.local_job(job, Path(workdir))["spec"]["training"]["tensorboard"]["dir"]
    console.print(f"TensorBoard: tensorboard --logdir {board}", highlight=False, markup=False)
    started = time.monotonic()
    live = (
        Live(console=console, refresh_per_second=4, transient=False)
        if console.is_terminal
        else None
    )
    last_print = [0.0]
    # (step, loss) each time the loss changed: the chief republishes its workers' mean loss
    # at each heartbeat, so between two the same loss stands at later steps
    losses: list[tuple[int, float]] = []
    recent = RecentRate()

    def tick(current: dict[str, Any], runner: local.LocalCluster) -> None:
        progress = current["status"].get("progress") or {}
        step, loss = int(progress.get("step") or 0), _number(progress.get("loss"))
        if loss is not None and step > 0 and (not losses or losses[-1][1] != loss):
            losses.append((step, loss))
        recent.observe(time.monotonic(), step)
        rate = recent.per_second()
        if live is not None:
            live.update(_table(current, runner, started=started, rate=rate))
        elif time.monotonic() - last_print[0] >= 5:
            last_print[0] = time.monotonic()
            state = current["status"].get("state", "Created")
            line = f"{state}: {progress_line(current, rate=rate)}"
            console.print(line, highlight=False, markup=False)

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (`jaxps.sdk`'s delete, a supervisor): stop every task

    signal.signal(signal.SIGTERM, terminate)
    try:
        if live is not None:
            live.start()
        status = local.run(job, workdir=Path(workdir), kills=kills, scales=scales, on_tick=tick)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every task stopped[/yellow]")
        return EXIT_INTERRUPTED
    except local.WorkdirGoneError as err:
        console.print(str(err), style="red", highlight=False, markup=False)
        return EXIT_FAILED
    finally:
        if live is not None:
            live.stop()
    state = status["state"]
    final = next((c for c in status.get("conditions", []) if c["type"] == state), None)
    console.print(  # a user's words (an exception's, a path) are text, never markup
        f"TrainingJob {job['metadata']['name']}: [bold]{state}[/bold]"
        + (escape(f" ({final['reason']}: {final['message']})") if final else ""),
        highlight=False,
    )
    curve = terminal_chart.chart(losses, label="step")
    if curve:
        console.print("loss:", highlight=False)
        for line in curve:
            console.print(line, highlight=False, markup=False)
    if args.json:  # strict JSON: a NaN loss is null, with a note saying so
        print(local.strict_json(status, indent=2, sort_keys=True))
    else:
        console.print_json(local.strict_json(status.get("progress", {})))
    return EXIT_SUCCEEDED if state == "Succeeded" else EXIT_FAILED


def _bounded(kind: type[int] | type[float], low: float, high: float) -> Any:
    """An argparse type: a number in [low, high], with an error that names both."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"got {text!r}; expected {'an integer' if kind is int else 'a number'}"
            ) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"got {text}; expected {low:g}..{high:g}")
        return value

    return parse


def run_operator(args: argparse.Namespace) -> int:
    # the watches and the API client load only for this command
    from jaxps_operator import controller  # noqa: PLC0415

    if args.liveness and not args.liveness.startswith(("http://", "https://")):
        print(
            f"jaxps operator: --liveness: got {args.liveness!r}; expected an http:// URL or ''",
            file=sys.stderr,
        )
        return EXIT_INVALID
    return controller.run(
        controller.Options(
            namespaces=tuple(args.namespaces),
            workers=args.workers,
            progress_interval=args.progress_interval,
            metrics_port=args.metrics_port or None,
            liveness=args.liveness or None,
            peering=args.peering,
            image=args.runtime_image,
            network_policy=args.network_policy,
            kueue=args.kueue,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxps",
        description="TensorFlow-style parameter-server training with JAX, on Kubernetes or here.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("validate", help="check manifests against the TrainingJob CRD")
    check.add_argument("files", nargs="+", type=Path, metavar="FILE")
    check.set_defaults(run=validate)
    here = commands.add_parser("local", help="run a TrainingJob on this machine")
    here.add_argument("file", type=Path, metavar="FILE")
    here.add_argument(
        "--workdir", type=Path, help="logs and checkpoints (default: .work/<name>-<time>)"
    )
    here.add_argument("--json", action="store_true", help="print the final status as JSON")
    here.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="TASK@step=N",
        help="SIGKILL a task when the chief reaches a step (shows recovery)",
    )
    here.add_argument(
        "--scale",
        action="append",
        default=[],
        metavar="worker=N@step=S",
        help="set the worker replicas to N when the chief reaches step S (repeatable; workers "
        "join, or the highest indexes drain and leave)",
    )
    here.set_defaults(run=run_local)
    ops = commands.add_parser(
        "operator",
        help="run the Kubernetes operator (uses $KUBECONFIG, or the pod's service account)",
    )
    ops.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        dest="namespaces",
        metavar="NS",
        help="a namespace to watch (repeatable; globs like 'team-*' allowed); default: all",
    )
    ops.add_argument(
        "--workers", type=_bounded(int, 1, 64), default=4, help="concurrent passes (default 4)"
    )
    ops.add_argument(
        "--progress-interval",
        type=_bounded(float, 0.5, 3600),
        default=10.0,
        metavar="SECONDS",
        help="how often a running chief's metrics are read into status.progress (default 10)",
    )
    ops.add_argument(
        "--metrics-port",
        type=_bounded(int, 0, 65535),
        default=8000,
        help="the operator's own Prometheus metrics; 0 turns them off (default 8000)",
    )
    ops.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="the liveness endpoint (kopf's: 200 once it serves); '' turns it off (default http://0.0.0.0:8080/healthz)",
    )
    ops.add_argument(
        "--peering",
        metavar="NAME",
        help="run as one of several replicas: the holder of the Lease NAME in the operator's "
        "namespace (POD_NAMESPACE) works, the others wait (default: standalone)",
    )
    ops.add_argument(
        "--runtime-image",
        default=builders.DEFAULT_IMAGE,
        metavar="IMAGE",
        help=f"the image of task pods whose template names none (default {builders.DEFAULT_IMAGE})",
    )
    ops.add_argument(
        "--network-policy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give every job a NetworkPolicy that admits only its own pods (and the operator to "
        "their metrics) (default: on)",
    )
    ops.add_argument(
        "--kueue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="jobs labelled kueue.x-k8s.io/queue-name wait for Kueue to admit their Workload "
        "(default: on; off: the label is ignored and no Workload is read)",
    )
    ops.set_defaults(run=run_operator)
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
