"""`kubectl jaxps`: TrainingJobs from kubectl (the `kubectl-jaxps` executable on PATH).

kubectl jaxps get [NAME]                       the jobs, or one: state, ready, restarts, step, loss
kubectl jaxps describe NAME                    conditions, replicas, progress and Events, one screen
kubectl jaxps logs NAME [TASK] [-f]            one task's log (worker-1), or every task's, prefixed
kubectl jaxps wait NAME [--for condition=C] [--timeout 600]
kubectl jaxps delete NAME [--no-wait]
kubectl jaxps top NAME [--once]                every task's step, loss, steps/s, staleness and
                                               bytes in and out per second, from its metrics
Every command takes -n/--namespace, --kubeconfig, --context and --request-timeout (seconds
for the API server to connect and to answer each request, default 30). Exit codes: 0 done, 1
the job failed, a wait timed out or the API server could not be reached, 2 bad usage or no
such job.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from jaxps.sdk.client import CONDITIONS, REQUEST_SECONDS, Client
from jaxps.sdk.kubernetes import KubernetesBackend
from jaxps.sdk.model import (
    JaxpsError,
    Job,
    JobFailedError,
    JobNotFoundError,
    ServerUnreachableError,
    WaitTimeoutError,
)
from jaxps_operator import builders

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # a pipe or a file: lines as wide as they are, not cut at 80 columns
    out = Console() if sys.stdout.isatty() else Console(width=200)
    err = Console(stderr=True, soft_wrap=True)  # an error is one line, however long
    try:
        backend = KubernetesBackend(
            namespace=args.namespace,
            kubeconfig=args.kubeconfig,
            context=args.context,
            timeout=args.request_timeout,
        )
        code: int = args.run(Client(backend), backend, args, out)
    except JobNotFoundError as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        return EXIT_USAGE
    except (JobFailedError, WaitTimeoutError, ServerUnreachableError) as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        return EXIT_FAILED
    except JaxpsError as e:
        err.print(f"error: {e}", highlight=False, markup=False)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubectl jaxps", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", help="default: the kubeconfig context's")
    common.add_argument("--kubeconfig", help="default: $KUBECONFIG, ~/.kube/config, in-cluster")
    common.add_argument("--context", help="the kubeconfig context to use")
    common.add_argument(
        "--request-timeout",
        type=_seconds,
        default=REQUEST_SECONDS,
        metavar="SECONDS",
        help=f"for the API server to connect, then to answer, per request "
        f"(default {REQUEST_SECONDS:g})",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    get = commands.add_parser("get", parents=[common], help="list jobs, or show one")
    get.add_argument("name", nargs="?")
    get.set_defaults(run=_get)

    describe = commands.add_parser("describe", parents=[common], help="one job in full")
    describe.add_argument("name")
    describe.set_defaults(run=_describe)

    logs = commands.add_parser("logs", parents=[common], help="a task's log, or every task's")
    logs.add_argument("name")
    logs.add_argument("task", nargs="?", help="e.g. worker-1 or ps-0 (default: every task)")
    logs.add_argument("-f", "--follow", action="store_true", help="go on as lines are written")
    logs.set_defaults(run=_logs)

    wait = commands.add_parser("wait", parents=[common], help="until a condition is true")
    wait.add_argument("name")
    wait.add_argument(
        "--for", dest="condition", default="condition=Succeeded", help="condition=TYPE"
    )
    wait.add_argument("--timeout", type=_seconds, default=600.0, help="seconds (default 600)")
    wait.set_defaults(run=_wait)

    delete = commands.add_parser("delete", parents=[common], help="the job and its pods")
    delete.add_argument("name")
    delete.add_argument("--no-wait", dest="wait", action="store_false")
    delete.set_defaults(run=_delete)

    top = commands.add_parser("top", parents=[common], help="live table of every task")
    top.add_argument("name")
    top.add_argument("--once", action="store_true", help="one table (two samples), then exit")
    top.add_argument("--interval", type=_seconds, default=2.0, help="seconds between samples")
    top.set_defaults(run=_top)
    return parser


def _seconds(text: str) -> float:
    try:
        value = float(text.removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected seconds, e.g. 600") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a number of seconds > 0")
    return value


# --- commands -------------------------------------------------------------------------------


def _get(client: Client, _: KubernetesBackend, args: argparse.Namespace, out: Console) -> int:
    jobs = [client.get(args.name)] if args.name else client.list()
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "STATE", "READY", "RESTARTS", "STEP", "LOSS", "AGE"):
        table.add_column(column)
    for job in jobs:
        ready = sum(r.ready for r in job.replicas)
        total = sum(r.replicas for r in job.replicas)
        table.add_row(
            job.name,
            job.state or "-",
            f"{ready}/{total}",
            str(job.restarts),
            f"{job.progress.step}/{job.progress.steps}",
            f"{job.progress.loss:.4f}" if job.progress.loss is not None else "-",
            _age(job.start_time),
        )
    if not jobs:
        out.print(f"No TrainingJobs in {client.backend.where}.", highlight=False)
    else:
        out.print(table)
    return EXIT_OK


def _describe(client: Client, _: KubernetesBackend, args: argparse.Namespace, out: Console) -> int:
    job = client.get(args.name)
    p = job.progress
    head = Table.grid(padding=(0, 2))
    for key, value in (
        ("Name", f"{job.name} (namespace {job.namespace})"),
        ("State", job.state or "-"),
        ("Started", f"{job.start_time or '-'}   Completed: {job.completion_time or '-'}"),
        ("Progress", _progress(job)),
        ("Last checkpoint", str(p.last_checkpoint_step if p.last_checkpoint_step else "-")),
        ("Eval", ", ".join(f"{k} {v:.4f}" for k, v in p.eval.items()) or "-"),
        ("Restarts", str(job.restarts)),
    ):
        head.add_row(f"[bold]{key}:[/bold]", Text(value))  # text, never markup
    replicas = Table(title="Replicas", title_justify="left", box=None, header_style="bold")
    for column in ("ROLE", "REPLICAS", "ACTIVE", "READY", "SUCCEEDED", "FAILED", "RESTARTS"):
        replicas.add_column(column)
    for r in job.replicas:
        replicas.add_row(
            r.role, *map(str, (r.replicas, r.active, r.ready, r.succeeded, r.failed, r.restarts))
        )
    conditions = Table(title="Conditions", title_justify="left", box=None, header_style="bold")
    for column in ("TYPE", "STATUS", "REASON", "MESSAGE"):
        conditions.add_column(column)
    for c in job.conditions:
        conditions.add_row(c.type, str(c.status), Text(c.reason), Text(c.message))
    events = Table(title="Events", title_justify="left", box=None, header_style="bold")
    for column in ("AGE", "TYPE", "REASON", "MESSAGE"):
        events.add_column(column)
    for e in client.events(job.name)[-10:]:
        events.add_row(_age(e.time), e.type, Text(e.reason), Text(e.message))
    out.print(Group(head, "", replicas, "", conditions, "", events))
    return EXIT_OK


def _logs(client: Client, _: KubernetesBackend, args: argparse.Namespace, out: Console) -> int:
    prefix = args.task is None
    for line in client.logs(args.name, args.task, follow=args.follow):
        text = f"[{line.task.removeprefix(args.name + '-')}] {line.text}" if prefix else line.text
        print(text, flush=args.follow)
    return EXIT_OK


def _wait(client: Client, _: KubernetesBackend, args: argparse.Namespace, out: Console) -> int:
    kind, _, condition = args.condition.partition("=")
    if kind != "condition" or not condition:
        raise JaxpsError(f"--for {args.condition!r}: expected condition=TYPE, e.g. Succeeded")
    if condition not in CONDITIONS:
        raise JaxpsError(
            f"--for {args.condition!r}: a TrainingJob has no condition {condition}; expected "
            f"one of {', '.join(CONDITIONS)}"
        )
    job = client.wait(args.name, condition, timeout=args.timeout)
    out.print(f"trainingjob.jaxps.dev/{job.name} condition met ({condition})", highlight=False)
    return EXIT_OK


def _delete(client: Client, _: KubernetesBackend, args: argparse.Namespace, out: Console) -> int:
    client.delete(args.name, wait=args.wait)
    out.print(f'trainingjob.jaxps.dev "{args.name}" deleted', highlight=False)
    return EXIT_OK


# --- top ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One task's metrics at one moment."""

    at: float
    values: Mapping[str, float]  # metric name (counters with _total) -> value


def parse_metrics(text: str) -> dict[str, float]:
    """The jaxps metrics of one task's Prometheus text (its own series, labels dropped)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("jaxps_") and "metric" not in sample.labels:
                values[sample.name] = float(sample.value)
    return values


SHOWN = {  # the columns each role reports; the others read "-", not a gauge's unset 0
    "ps": {"step", "staleness", "in", "out"},
    "chief": {"step", "loss", "steps/s"},
    "worker": {"step", "loss"},
    "evaluator": {"step"},
}


def top_row(before: Sample | None, now: Sample, *, role: str, chief: bool = False) -> list[str]:
    """step, loss, steps/s, staleness, bytes in/s, bytes out/s of one task; `chief`: the
    worker that is the chief (worker 0 without a chief task) reports steps/s."""
    shown = SHOWN["chief"] if chief else SHOWN.get(role, {"step"})

    def show(column: str, key: str, fmt: str) -> str:
        value = now.values.get(key)
        return format(value, fmt) if value is not None and column in shown else "-"

    def rate(column: str, key: str) -> str:
        if column not in shown or before is None or now.at <= before.at or key not in now.values:
            return "-"
        per_second = (now.values[key] - before.values.get(key, 0.0)) / (now.at - before.at)
        return _bytes(max(per_second, 0.0)) + "/s"

    return [
        show("step", "jaxps_global_step", ".0f"),
        show("loss", "jaxps_loss", ".4f"),
        show("steps/s", "jaxps_steps_per_second", ".1f"),
        show("staleness", "jaxps_staleness", ".0f"),
        rate("in", "jaxps_bytes_pushed_total"),
        rate("out", "jaxps_bytes_pulled_total"),
    ]


def _top(client: Client, backend: KubernetesBackend, args: argparse.Namespace, out: Console) -> int:
    client.get(args.name)  # no such job: JobNotFoundError
    previous: dict[str, Sample] = {}

    def table() -> Table:
        job = client.get(args.name)
        pods = backend.pods(args.name)
        grid = Table(
            title=f"TrainingJob {job.name}  {job.state or '-'}  {_progress(job)}",
            title_justify="left",
            header_style="bold",
            box=None,
        )
        for column in ("TASK", "PHASE", "STEP", "LOSS", "STEPS/S", "STALENESS", "IN", "OUT"):
            grid.add_column(column, justify="left" if column in ("TASK", "PHASE") else "right")
        for name in sorted(pods):
            pod = pods[name]
            phase = pod["status"].get("phase", "?")
            text = backend.metrics(pod) if phase == "Running" else ""
            now = Sample(at=time.monotonic(), values=parse_metrics(text))
            labels = pod["metadata"].get("labels") or {}
            role = labels.get(builders.LABEL_ROLE, "")
            chief = role == "chief" or (
                role == "worker"
                and labels.get(builders.LABEL_INDEX) == "0"
                and not any(r.role == "chief" for r in job.replicas)
            )
            row = (
                top_row(previous.get(name), now, role=role, chief=chief)
                if now.values
                else ["-"] * 6
            )
            if now.values:
                previous[name] = now
            grid.add_row(name.removeprefix(args.name + "-"), phase, *row)
        return grid

    if args.once or not out.is_terminal:
        table()
        time.sleep(args.interval)
        out.print(table())
        return EXIT_OK
    with Live(table(), console=out, refresh_per_second=1) as live:
        while True:
            time.sleep(args.interval)
            live.update(table())


# --- formatting -----------------------------------------------------------------------------


def _progress(job: Job) -> str:
    p = job.progress
    parts = [f"step {p.step}/{p.steps}"]
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4f}")
    if p.steps_per_second:
        parts.append(f"{p.steps_per_second:.1f} steps/s")
    return "  ".join(parts)


def _age(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    seconds = int((datetime.now(UTC) - moment).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


if __name__ == "__main__":
    sys.exit(main())
