"""Sends every manifest of the invalid-manifest catalogue to a real kube-apiserver (server-side
dry run, strict field validation) and prints whether it was refused and the apiserver's words.

    python hack/catalogue-vs-apiserver.py KUBECONFIG    (the CRD installed; kubectl on PATH or
                                                         from hack/control-plane.sh bin)

A developer's check until the cluster test tier (issue 6) runs the catalogue in `make test`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from test_manifests import CATALOGUE  # noqa: E402


def main() -> int:
    kubeconfig = sys.argv[1]
    kubectl = shutil.which("kubectl") or str(
        Path(
            subprocess.run(
                [str(ROOT / "hack" / "control-plane.sh"), "bin"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        / "kubectl"
    )
    refused = 0
    for name, manifest, _ in CATALOGUE:
        done = subprocess.run(
            [
                kubectl,
                "--kubeconfig",
                kubeconfig,
                "apply",
                "--dry-run=server",
                "--validate=strict",
                "-f",
                "-",
            ],
            input=json.dumps(manifest),
            capture_output=True,
            text=True,
            check=False,
        )
        refused += done.returncode != 0
        first = next(
            (
                line
                for line in (done.stderr or done.stdout).splitlines()
                if "Invalid value" in line or "Error" in line or "error" in line
            ),
            "",
        )
        print(f"{'refused ' if done.returncode else 'ACCEPTED'} {name:32s} {first.strip()[:140]}")
    print(f"the apiserver refused {refused} of {len(CATALOGUE)}")
    return 0 if refused == len(CATALOGUE) else 1


if __name__ == "__main__":
    sys.exit(main())
