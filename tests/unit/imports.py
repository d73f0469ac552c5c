"""Code run in a fresh interpreter: which modules it loads (this one has loaded everything
already), or what it does to process-wide state this one must keep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def run(code: str) -> str:
    """What `code` prints, run in a new interpreter with the runtime on its path; an error in
    it fails with its output."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(RUNTIME)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def loaded_by(code: str, modules: Sequence[str]) -> list[str]:
    """Those of `modules` that are loaded once `code` has run in a new interpreter."""
    names = json.dumps(list(modules))
    script = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted(m for m in json.loads({names!r}) if m in sys.modules)))"
    )
    found: list[str] = json.loads(run(script).splitlines()[-1])
    return found
