"""Every benchmark in one run, as `make bench` runs them, and the docs' table from that run.

    python bench/suite.py --tf-python .venv-tf/bin/python [--out .bench/results.jsonl]
        [--readme docs/benchmarks.md] [--only operator.py ...]
    python bench/suite.py --table .bench/results.jsonl [--readme docs/benchmarks.md]

Runs each command of `COMMANDS` in turn (their progress on stderr comes through), passes every
JSON line on to stdout as it comes, and keeps it in `--out` with the command that printed it.
At the end it prints the markdown table of the run (every measurement: case, metric, jaxps, the
baseline measured in the same run, the ratio, the command); `--readme` writes that table into
the page given (docs/benchmarks.md) between `<!-- bench:begin -->` and `<!-- bench:end -->`,
under a line naming the day (the kept run also records the commit). `--table` makes the table
from a kept run without running anything.

A command that fails is named on stderr and makes the exit status 1; the others still run, and
the table says which produced nothing. `recovery.py --kubernetes` and `admission.py` start the
one-node cluster and so need root (`make bench` builds what it needs first).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
TF_PYTHON = "TF_PYTHON"  # replaced by --tf-python
COMMANDS = (
    "transport.py",
    "training.py",
    "embeddings.py",
    "recovery.py",
    "recovery.py --kubernetes",
    "admission.py",
    "operator.py --baseline kubeflow",
    "status_write.py",
    f"vs_tensorflow.py --tf-python {TF_PYTHON} --rounds 3",
)
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
Row = dict[str, object]


def run(command: str, tf_python: str) -> tuple[str, list[Row], int]:
    """Runs one bench command: the command as shown, its JSON lines (passed on to stdout) and
    its exit status."""
    command = command.replace(TF_PYTHON, tf_python)
    script, *args = shlex.split(command)
    shown = f"python bench/{command}"
    print(f"==> {shown}", file=sys.stderr, flush=True)
    rows: list[Row] = []
    with subprocess.Popen(
        [sys.executable, str(HERE / "bench" / script), *args],
        cwd=HERE,
        stdout=subprocess.PIPE,
        text=True,
    ) as bench:
        assert bench.stdout is not None
        for line in bench.stdout:
            print(line, end="", flush=True)
            if line.startswith("{"):
                row = json.loads(line)
                row["command"] = shown
                rows.append(row)
    return shown, rows, bench.returncode


def figure(value: object, unit: object) -> str:
    if not isinstance(value, int | float):
        return "-"
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return f"{text} {unit}".strip()


def table(rows: list[Row], failed: list[str]) -> str:
    """The markdown table of a run: one line per measurement, in the order they came."""
    lines = [
        "| bench | case | metric | jaxps | baseline (same run) | ratio | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        baseline = (
            f"{row['baseline']}: {figure(row['baseline_value'], row['unit'])}"
            if row.get("baseline")
            else "-"
        )
        ratio = (
            f"{row['ratio']}\N{MULTIPLICATION SIGN}"
            if isinstance(row.get("ratio"), int | float)
            else "-"
        )
        cells = (
            row["bench"],
            row["case"],
            row["metric"],
            figure(row["value"], row["unit"]),
            baseline,
            ratio,
            f"`{row['command']}`",
        )
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    lines.extend(f"\n**`{command}` failed: its figures are missing.**" for command in failed)
    return "\n".join(lines)


def commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=HERE,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown"


def write_readme(readme: Path, text: str) -> None:
    """Puts `text` between the bench markers of the page `readme`."""
    content = readme.read_text()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} block to write the table into")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tf-python", default=".venv-tf/bin/python")
    parser.add_argument("--out", type=Path, default=HERE / ".bench" / "results.jsonl")
    parser.add_argument(
        "--readme", type=Path, help="write the table into this page (docs/benchmarks.md)"
    )
    parser.add_argument("--only", nargs="+", help="run only the commands of these scripts")
    parser.add_argument("--table", type=Path, help="make the table of a kept run; run nothing")
    args = parser.parse_args()

    failed: list[str] = []
    if args.table:
        kept = [json.loads(line) for line in args.table.read_text().splitlines() if line]
        rows = [row for row in kept if "bench" in row]
        failed = [str(row["failed"]) for row in kept if "failed" in row]
        # the day only: a run kept by an older suite said "<commit> on <day>"
        when = next((str(row["run"]) for row in kept if "run" in row), "unknown")
        when = when.rsplit(" on ", 1)[-1]
    else:
        commands = [c for c in COMMANDS if not args.only or shlex.split(c)[0] in args.only]
        when = datetime.date.today().isoformat()
        rows = []
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w") as out:
            out.write(json.dumps({"run": when, "commit": commit()}) + "\n")
            for command in commands:
                shown, got, status = run(command, args.tf_python)
                rows += got
                out.writelines(json.dumps(row) + "\n" for row in got)
                if status:
                    failed.append(shown)
                    out.write(json.dumps({"failed": shown}) + "\n")
                    print(f"{shown} exited {status}", file=sys.stderr)
                out.flush()
    text = f"One `make bench` run at {when}, on this project's 2-core machine.\n\n" + table(
        rows, failed
    )
    print(text, file=sys.stderr)
    if args.readme:
        write_readme(args.readme, text)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
