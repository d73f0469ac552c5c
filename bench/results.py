"""One JSON line per measurement, in the format DEVELOPERS.md gives for every bench script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def emit(
    bench: str,
    case: str,
    *,
    metric: str,
    value: float,
    unit: str,
    baseline: str | None = None,
    baseline_value: float | None = None,
    lower_is_better: bool = False,
    **extra: object,
) -> None:
    """Prints the measurement; `ratio` is above 1 when jaxps does better than the baseline:
    value / baseline for throughputs, baseline / value for times (`lower_is_better`); `extra`
    fields after the format's (a note, each round's values)."""
    if not baseline_value or not value:
        ratio = None
    else:
        ratio = baseline_value / value if lower_is_better else value / baseline_value
    print(
        json.dumps(
            {
                "bench": bench,
                "case": case,
                "metric": metric,
                "value": round(value, 4),
                "unit": unit,
                "baseline": baseline,
                "baseline_value": round(baseline_value, 4) if baseline_value else None,
                "ratio": round(ratio, 3) if ratio else None,
                **extra,
            }
        ),
        flush=True,
    )


def on_the_node(bench_file: str, env: Mapping[str, str]) -> int:
    """Runs tests/e2e/`bench_file` under pytest (the e2e tier's node and fixtures: root) with
    `env` added, prints its JSON lines, and returns its exit code (its output on stderr when it
    failed or measured nothing)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "e2e" / bench_file),
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"bench"')]
    for line in lines:
        print(line, flush=True)
    if done.returncode != 0 or not lines:
        print(done.stdout[-6000:], done.stderr[-3000:], file=sys.stderr)
    return done.returncode or (0 if lines else 1)
