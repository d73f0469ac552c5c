"""Benchmarks of this tree against another commit's, alternating in one run on one machine.

    python bench/against.py REF [--rounds 2] [--bench "transport.py --repeats 3" ...]

For a change that must not change speed (a refactor): REF (e.g. the commit before it) is
checked out into a temporary git worktree, and every bench command runs there (that tree's
code and bench scripts) and here, alternating (REF, here, REF, here, ...) `--rounds` times.
Each bench's own JSON lines come through with `"tree": "REF" | "HEAD"` added; the summary
after them gives, per measurement, the median ratio to its baseline in each tree and their
quotient (`after / before`: 1.0 is no change; the bench's own baseline is measured in the
same process, so the quotient is robust to a busy machine). The worktree is removed at the end.
Without `--bench` the commands are those of `make bench-tf` and of the transport and training
benches of `make bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
DEFAULT = (
    "transport.py --repeats 3",
    "training.py --steps 300",
    "vs_tensorflow.py --rounds 1 --tf-python .venv-tf/bin/python",
)


def _run(tree: Path, name: str, command: str) -> list[dict[str, object]]:
    script, *args = shlex.split(command)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "runtime"), str(tree / "operator"), str(tree)])
    env.setdefault("JAX_PLATFORMS", "cpu")
    args = [str(HERE / a) if a.startswith(".venv") else a for a in args]  # one TF venv: here
    done = subprocess.run(
        [sys.executable, str(tree / "bench" / script), *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    rows = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            row["tree"] = name
            print(json.dumps(row), flush=True)
            rows.append(row)
    if done.returncode:
        print(f"{name}: {command} exited {done.returncode}: {done.stderr[-2000:]}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", help="the commit to compare against (e.g. HEAD~5)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bench", action="append", help="a bench/ script and its arguments")
    args = parser.parse_args(argv)
    commands = args.bench or list(DEFAULT)
    ratios: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    with tempfile.TemporaryDirectory(prefix="jaxps-against-") as scratch:
        before = Path(scratch) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(before), args.ref],
            cwd=HERE,
            check=True,
        )
        try:
            for _ in range(args.rounds):
                for command in commands:
                    for name, tree in ((args.ref, before), ("HEAD", HERE)):
                        for row in _run(tree, name, command):
                            if isinstance(row.get("ratio"), (int, float)):
                                key = (str(row["bench"]), str(row["case"]), str(row["metric"]))
                                ratios[key][name].append(float(row["ratio"]))  # type: ignore[arg-type]
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(before)], cwd=HERE, check=False
            )
    print(f"\n{'bench / case / metric':62} {'before':>8} {'after':>8} {'after/before':>12}")
    for key in sorted(ratios):
        old, new = ratios[key].get(args.ref), ratios[key].get("HEAD")
        if not old or not new:
            continue
        a, b = statistics.median(old), statistics.median(new)
        print(f"{' / '.join(key):62} {a:8.3f} {b:8.3f} {b / a:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
