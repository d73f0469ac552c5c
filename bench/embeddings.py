"""Dynamic embedding tables (`training.embeddings`): throughput, the bound held, bytes per row.

Prints one JSON object per measurement (DEVELOPERS.md format). Three measurements:

1. `dynamic-2ps-<W>w-async`: a `jaxps local` job of 2 ps and W workers (async) training the
   built-in `embedding` model (one table of dim 16 read sparsely, a dense layer; Adam) whose
   table is a dynamic one of maxRows 200,000 (LRU, admitted on first sight), on a stream where
   every id is a distinct 64-bit id (`embeddings_data`: a mix of a running counter), so that
   `--distinct-ids` (20M by default) distinct ids flow through the run. While it runs, every
   ps's `jaxps_ps_embedding` gauges are polled (`--poll-seconds`): the largest sum of
   `resident` over the ps must never pass maxRows. The series is written to `--series`
   (.work/bench/embeddings-resident.json) for a plot or a table. Reported: steps/s, examples/s,
   resident rows at most (ratio maxRows / it: at least 1 when the bound held), the distinct
   ids streamed (steps x batch x ids per example, counted by the generator's construction),
   and admitted, evicted, lookups and the hit rate from the chief's final summary.
2. `fixed-2ps-<W>w-async`: the baseline, in the same run: the same model, batch, optimizer and
   steps with a FIXED table of 200,000 rows (no `embeddings` entry; ids in [0, 200000)). The
   dynamic case's steps/s ratio is dynamic / fixed (issue 58 wants at least 0.7). Each case
   runs `--rounds` times (3), the cases alternating; its steps/s is the median.
3. `dynamic-table-dim16-adam`: bytes per row, measured: a fresh Python process builds
   `jaxps_runtime.ps.dynamic.Table` (dim 16, optax.adam) of `--rows` rows and pushes that many
   distinct ids (every row resident); bytes/row = its RSS after filling minus before creating
   the table, over the rows. (Before that, a small table of the same push sizes is filled and
   dropped, so that the jitted update is compiled outside the measured span: that is paid once
   per process, not per row.) Baseline: TensorFlow Recommenders-Addons' dynamic_embedding,
   235 to 450 B/row as published (`ratio` = theirs / ours, above 1: smaller); a fixed table's
   16 float32 x (value, Adam's mu and nu) = 192 B/row is printed beside it, computed.

    python bench/embeddings.py                       # 20M distinct ids (~2,450 steps) a case
    python bench/embeddings.py --quick               # 200k distinct ids: a smoke test
    python bench/embeddings.py [--workers 2] [--batch-size 1024] [--ids-per-example 8]
        [--distinct-ids N | --steps S] [--max-rows 200000] [--only dynamic,fixed,bytes]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import results  # bench/results.py: this script's folder is on sys.path

BENCH = "embeddings"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DIM = 16
TFRA_BYTES_PER_ROW = (235.0, 450.0)  # TFRA dynamic_embedding, as published: low and high
FIXED_BYTES_PER_ROW = DIM * 4 * 3  # float32 value, Adam's mu and nu
METRICS_LINE = re.compile(r"metrics on http://(?P<address>[^/\s]+)/metrics")
GAUGE = re.compile(
    r"^jaxps_ps_embedding\{(?P<labels>[^}]*)\}\s+(?P<value>[-+0-9.eEinfaINF]+)\s*$", re.M
)
LABEL = re.compile(r'(\w+)="([^"]*)"')
STEP = re.compile(r"^jaxps_global_step(?:\{[^}]*\})?\s+(?P<value>[-+0-9.eE]+)\s*$", re.M)
JOB_TIMEOUT_SECONDS = 3600.0


def emit(case: str, **fields: Any) -> None:
    """One measurement of this bench (`results.emit`)."""
    results.emit(BENCH, case, **fields)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- the jobs ----------------------------------------------------------------------------------


def manifest(
    name: str, *, dynamic: bool, workers: int, steps: int, batch: int, ids: int, max_rows: int
) -> dict[str, Any]:
    """The job: 2 ps, `workers` workers (worker-0 the chief), async, the built-in embedding
    model on `embeddings_data`; its table dynamic (the model's own declared 2 rows: a dynamic
    table's rows are the ps's) or fixed at `max_rows` rows (ids drawn in [0, max_rows))."""
    training: dict[str, Any] = {
        "model": {
            "name": "embedding",
            "kwargs": {"rows": 2 if dynamic else max_rows, "dim": DIM, "idsPerExample": ids},
        },
        "dataset": {
            "module": "embeddings_data:make",
            "kwargs": {"idsPerExample": ids, "idRange": 0 if dynamic else max_rows},
        },
        "mode": "async",
        "steps": steps,
        "batchSize": batch,
        "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.001}},
        "logEverySeconds": 30,
    }
    if dynamic:
        training["embeddings"] = {"embedding": {"dim": DIM, "maxRows": max_rows, "eviction": "lru"}}
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {"ps": {"replicas": 2}, "worker": {"replicas": workers}},
            "training": training,
        },
    }


@dataclasses.dataclass
class Poll:
    """One read of every ps's `jaxps_ps_embedding` gauges (and the chief's global step)."""

    seconds: float  # since the job started
    step: int | None
    parts: dict[str, dict[str, float]]  # task -> what -> value (the one table)

    @property
    def resident(self) -> int:
        return int(sum(part.get("resident", 0.0) for part in self.parts.values()))

    def to_json(self) -> dict[str, Any]:
        return {
            "t": round(self.seconds, 3),
            "step": self.step,
            "resident": self.resident,
            "parts": self.parts,
        }


@dataclasses.dataclass
class Job:
    summary: dict[str, Any]
    status: dict[str, Any]
    seconds: float
    polls: list[Poll]
    workdir: Path


def _metrics_address(log: Path) -> str | None:
    """The address a task serves its metrics on, from its log ("metrics on http://.../metrics",
    the line every task logs once it listens); None before that."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    found = METRICS_LINE.search(text)
    return found.group("address") if found else None


def _scrape(address: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as reply:
            text: str = reply.read().decode()
            return text
    except OSError:
        return None


def _parts(text: str, table: str) -> dict[str, dict[str, float]]:
    """`jaxps_ps_embedding{task, table, what}` of `table` in a scrape: task -> what -> value."""
    out: dict[str, dict[str, float]] = {}
    for found in GAUGE.finditer(text):
        labels = dict(LABEL.findall(found.group("labels")))
        if labels.get("table") == table:
            task = labels.get("task", "?")
            out.setdefault(task, {})[labels.get("what", "?")] = float(found.group("value"))
    return out


class Poller:
    """Polls the job's ps (and its chief's step) every `every` seconds from a thread, until
    stopped. The addresses are taken from the tasks' logs in the work directory."""

    def __init__(self, workdir: Path, name: str, *, table: str, every: float) -> None:
        self.workdir, self.name, self.table, self.every = workdir, name, table, every
        self.polls: list[Poll] = []
        self.addresses: dict[str, str] = {}
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        tasks = [f"{self.name}-ps-0", f"{self.name}-ps-1", f"{self.name}-worker-0"]
        while not self._stop.wait(self.every):
            for task in tasks:
                if task not in self.addresses:
                    address = _metrics_address(self.workdir / f"{task}.log")
                    if address:
                        self.addresses[task] = address
            parts: dict[str, dict[str, float]] = {}
            step = None
            for task, address in self.addresses.items():
                text = _scrape(address)
                if text is None:
                    continue
                if "-ps-" in task:
                    parts.update(_parts(text, self.table))
                else:
                    found = STEP.search(text)
                    step = int(float(found.group("value"))) if found else None
            if parts:
                self.polls.append(Poll(time.monotonic() - self._started, step, parts))


def _summary(log: Path) -> dict[str, Any] | None:
    """The chief's final summary: the last JSON line of its log with `stepsPerSecond`."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{") and '"stepsPerSecond"' in line:
            try:
                found: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            return found
    return None


def run_job(job: dict[str, Any], *, root: Path, poll: float | None) -> Job:
    """Runs `job` with `jaxps local --json` in `root`/<name>; polls its ps while it runs
    (every `poll` seconds; None: not at all). Raises with the tasks' log tails if it fails."""
    name = job["metadata"]["name"]
    workdir = root / name
    if workdir.exists():
        subprocess.run(["rm", "-rf", str(workdir)], check=True)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(job, indent=1))  # JSON is YAML
    # the dataset module alone on the tasks' path: bench/ itself has an `operator.py`, which
    # would shadow the standard library's
    user = root / "user"
    user.mkdir(exist_ok=True)
    (user / "embeddings_data.py").write_text((HERE / "embeddings_data.py").read_text())
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(user), str(ROOT / "operator"), str(ROOT / "runtime")]),
    }
    command = [sys.executable, "-m", "jaxps_operator", "local", str(path), "--json"]
    poller = Poller(workdir, name, table="embedding", every=poll or 1.0)
    started = time.monotonic()
    with subprocess.Popen(
        [*command, "--workdir", str(workdir)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as local:
        if poll is not None:
            poller.start()
        try:
            stdout, stderr = local.communicate(timeout=JOB_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            local.terminate()  # SIGTERM: `jaxps local` stops every task it started
            stdout, stderr = local.communicate(timeout=60)
        finally:
            if poll is not None:
                poller.stop()
    seconds = time.monotonic() - started
    status = json.loads(stdout) if stdout.strip().startswith("{") else {}
    summary = _summary(workdir / f"{name}-worker-0.log") or dict(status.get("progress") or {})
    if local.returncode != 0 or status.get("state") != "Succeeded" or not summary:
        tails = "\n".join(
            f"--- {log.name} (last 40 lines)\n"
            + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            for log in sorted(workdir.glob("*.log"))
        )
        raise RuntimeError(
            f"job {name} did not succeed (exit {local.returncode}, state "
            f"{status.get('state')!r}); jaxps local's stderr:\n{stderr[-3000:]}\n{tails}"
        )
    return Job(summary, status, seconds, poller.polls, workdir)


# --- bytes per row -----------------------------------------------------------------------------


def _rss() -> tuple[int, int]:
    """This process's resident set now and at most (VmRSS, VmHWM), in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def fill_table(rows: int, chunk: int) -> dict[str, Any]:
    """In this process: RSS before a dynamic Table (dim 16, Adam) of `rows` rows is made, and
    after `rows` distinct ids were pushed into it (every row resident), in chunks of `chunk`."""
    import numpy as np
    import optax

    from jaxps_runtime.ps.dynamic import Spec, Table
    from jaxps_runtime.wire.tables import mix64

    tx = optax.adam(1e-3)
    sizes = [chunk] * (rows // chunk) + ([rows % chunk] if rows % chunk else [])

    def fill(table: Table, first: int, pushes: list[int]) -> None:
        for step, n in enumerate(pushes, start=1):
            ids = np.sort(mix64(np.arange(first, first + n, dtype=np.uint64)).view(np.int64))
            grads = np.full((n, DIM), 0.01, np.float32)
            if not table.push(step, ids, np.ones(n, np.int64), grads):
                raise RuntimeError("a push was refused (rows not finite)")
            first += n

    # compile the jitted update for these push sizes outside the measured span (once a process)
    warm = Table(Spec(name="warm", dim=DIM, max_rows=2 * chunk), tx)
    fill(warm, 1 << 60, [chunk, *sizes[-1:], chunk, chunk])
    del warm
    gc.collect()
    before, peak_before = _rss()
    table = Table(Spec(name="t", dim=DIM, max_rows=rows), tx)
    made, _ = _rss()
    fill(table, 0, sizes)
    gc.collect()
    after, peak = _rss()
    if table.resident != rows or table.counters.evicted:
        raise RuntimeError(f"{table.resident} rows resident of {rows}: the table is not full")
    return {
        "rows": rows,
        "rss_before": before,
        "rss_made": made,
        "rss_after": after,
        "hwm_before": peak_before,
        "hwm_after": peak,
    }


def bytes_per_row(rows: int, chunk: int) -> dict[str, Any]:
    """`fill_table` in a fresh Python process (nothing else of this one's in its RSS)."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__)), "--fill-table", str(rows), "--chunk", str(chunk)],
        env={**os.environ, "PYTHONPATH": str(ROOT / "runtime"), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the table process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


# --- main --------------------------------------------------------------------------------------


def report_jobs(args: argparse.Namespace, steps: int, only: set[str]) -> bool:
    """Runs the jobs of `only` and prints their measurements; False when the dynamic job's
    resident rows were seen past maxRows (or never seen at all)."""
    per_step = args.batch_size * args.ids_per_example
    cases = [c for c in ("dynamic", "fixed") if c in only]
    jobs: dict[str, Job] = {}
    rates: dict[str, list[float]] = {kind: [] for kind in cases}
    most_resident = 0
    # rounds, the cases alternating: a machine whose speed drifts (another job, the clock)
    # moves both cases' medians alike, not one case's single run
    for round_ in range(args.rounds):
        for kind in cases:
            name = f"emb-{kind}"
            job = manifest(
                name,
                dynamic=kind == "dynamic",
                workers=args.workers,
                steps=steps,
                batch=args.batch_size,
                ids=args.ids_per_example,
                max_rows=args.max_rows,
            )
            say(
                f"==> {kind} (round {round_ + 1}/{args.rounds}): {steps} steps of {per_step} "
                f"ids, 2 ps, {args.workers} workers, async"
            )
            jobs[kind] = run_job(
                job, root=args.workdir, poll=args.poll_seconds if kind == "dynamic" else None
            )
            rates[kind].append(float(jobs[kind].summary["stepsPerSecond"]))
            if kind == "dynamic":
                polled = [p.resident for p in jobs[kind].polls]
                most_resident = max([most_resident, *polled])
            say(
                f"    {jobs[kind].summary.get('stepsPerSecond')} steps/s, "
                f"{jobs[kind].seconds:.0f} s in all"
            )
    label = f"2ps-{args.workers}w-async"
    held = True
    fixed = jobs.get("fixed")
    fixed_rate = statistics.median(rates["fixed"]) if fixed else None
    baseline = f"fixed table {args.max_rows:,} rows" if fixed else None
    dynamic = jobs.get("dynamic")
    if dynamic is not None:
        case = f"dynamic-{label}"
        rate = statistics.median(rates["dynamic"])
        emit(
            case,
            metric="steps_per_second",
            value=rate,
            unit="steps/s",
            baseline=baseline,
            baseline_value=fixed_rate,
            target_ratio=0.7,
            rounds=rates["dynamic"],
            baseline_rounds=rates.get("fixed"),
        )
        emit(
            case,
            metric="examples_per_second",
            value=rate * args.batch_size,
            unit="examples/s",
            baseline=baseline,
            baseline_value=fixed_rate * args.batch_size if fixed_rate else None,
        )
        polls = dynamic.polls
        most = most_resident
        emit(
            case,
            metric="resident_rows_max",
            value=float(most),
            unit="rows",
            baseline="maxRows (the bound)",
            baseline_value=float(args.max_rows),
            lower_is_better=True,
            polls=len(polls),
            within_bound=bool(polls) and most <= args.max_rows,
        )
        done_steps = int(dynamic.summary.get("step") or steps)
        emit(case, metric="distinct_ids_streamed", value=float(done_steps * per_step), unit="ids")
        table = (dynamic.summary.get("embeddings") or {}).get("embedding")
        if table is None:
            say("    the chief's summary has no embeddings.embedding: admitted/evicted unknown")
        else:
            if int(table["admitted"]) != done_steps * per_step:  # every id new, minCount 1
                say(
                    f"    note: {table['admitted']:,} admitted, not the {done_steps * per_step:,} "
                    "distinct ids streamed"
                )
            for key, unit in (
                ("admitted", "rows"),
                ("evicted", "rows"),
                ("lookups", "ids"),
                ("resident", "rows"),
            ):
                emit(case, metric=f"final_{key}", value=float(table[key]), unit=unit)
            emit(case, metric="final_hit_rate", value=float(table["hitRate"]), unit="")
        series = {
            "bench": BENCH,
            "case": case,
            "maxRows": args.max_rows,
            "steps": done_steps,
            "idsPerStep": per_step,
            "pollSeconds": args.poll_seconds,
            "residentMax": most,
            "withinBound": bool(polls) and most <= args.max_rows,
            "summary": table,
            "series": [p.to_json() for p in polls],
        }
        args.series.parent.mkdir(parents=True, exist_ok=True)
        args.series.write_text(json.dumps(series, indent=1))
        held = bool(polls) and most <= args.max_rows
        say(
            f"    resident rows at most {most:,} of {args.max_rows:,} over {len(polls)} polls "
            f"({'within' if held else 'NOT within'} the bound); series in {args.series}"
        )
    if fixed is not None:
        emit(
            f"fixed-{label}",
            metric="steps_per_second",
            value=float(fixed_rate or 0.0),
            unit="steps/s",
            rounds=rates["fixed"],
        )
    return held


def report_bytes(args: argparse.Namespace) -> None:
    say(f"==> bytes per row: a dynamic Table of {args.rows:,} rows, dim {DIM}, Adam, filled")
    found = bytes_per_row(args.rows, args.chunk)
    per_row = (found["rss_after"] - found["rss_before"]) / found["rows"]
    made = (found["rss_made"] - found["rss_before"]) / found["rows"]
    peak = (found["hwm_after"] - found["rss_before"]) / found["rows"]
    say(f"    {per_row:.1f} B/row (made empty: {made:.1f}; peak RSS over the start: {peak:.1f})")
    case = f"dynamic-table-dim{DIM}-adam"
    low, high = TFRA_BYTES_PER_ROW
    for published in (low, high):
        emit(
            case,
            metric="bytes_per_row",
            value=per_row,
            unit="B/row",
            baseline="TFRA dynamic_embedding",
            baseline_value=published,
            lower_is_better=True,
            rows=found["rows"],
            note=(
                f"RSS of a fresh process after filling {found['rows']:,} rows minus before "
                f"making the table; TFRA's published figure is {low:.0f}-{high:.0f} B/row "
                f"(this line: {published:.0f})"
            ),
        )
    emit(
        f"fixed-table-dim{DIM}-adam",
        metric="bytes_per_row",
        value=float(FIXED_BYTES_PER_ROW),
        unit="B/row",
        note=f"computed, not measured: {DIM} float32 x (value, Adam mu, Adam nu)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200k distinct ids: a smoke test")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--ids-per-example", type=int, default=8)
    parser.add_argument("--distinct-ids", type=int, default=20_000_000)
    parser.add_argument("--steps", type=int, default=None, help="instead of --distinct-ids")
    parser.add_argument("--max-rows", type=int, default=200_000)
    parser.add_argument("--poll-seconds", type=float, default=0.5)
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each case, alternating (medians)"
    )
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the bytes/row table")
    parser.add_argument("--chunk", type=int, default=4096, help="ids per push filling it")
    parser.add_argument("--only", default="dynamic,fixed,bytes")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".work" / "bench" / "embeddings")
    parser.add_argument(
        "--series", type=Path, default=ROOT / ".work" / "bench" / "embeddings-resident.json"
    )
    parser.add_argument("--fill-table", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fill_table is not None:  # the bytes/row child
        sys.path.insert(0, str(ROOT / "runtime"))
        print(json.dumps(fill_table(args.fill_table, args.chunk)), flush=True)
        return 0
    if args.quick and args.distinct_ids == parser.get_default("distinct_ids"):
        args.distinct_ids = 200_000
    per_step = args.batch_size * args.ids_per_example
    steps = args.steps or math.ceil(args.distinct_ids / per_step)
    only = set(args.only.split(","))
    if unknown := only - {"dynamic", "fixed", "bytes"}:
        parser.error(f"--only: unknown {sorted(unknown)}")
    started = time.monotonic()
    if "bytes" in only:
        report_bytes(args)
    held = report_jobs(args, steps, only) if only & {"dynamic", "fixed"} else True
    say(f"==> done in {time.monotonic() - started:.0f} s")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
