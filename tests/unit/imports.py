"""Which modules a piece of code loads, seen from a fresh interpreter (this one has loaded
everything already)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def loaded_by(code: str, modules: Sequence[str]) -> list[str]:
    """Those of `modules` that are loaded once `code` has run in a new interpreter with the
    runtime on its path; an error in `code` fails with its output."""
    script = f"{code}\nimport sys\nprint(sorted(m for m in {tuple(modules)!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(RUNTIME)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found: list[str] = eval(done.stdout.strip().splitlines()[-1])
    return found
