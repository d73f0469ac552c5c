"""Kubeflow's training-operator v1.9.3, the operator benches' baseline: `control_plane` runs
hack/control-plane.sh (`kubeflow` builds the operator and its CRD once, `kubeflow-dir` says
where), and `tf_job` is a TFJob of the same tasks as a bench's TrainingJob."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TF_KINDS = {"chief": "Chief", "ps": "PS", "worker": "Worker", "evaluator": "Evaluator"}


def control_plane(*argv: str) -> str:
    """hack/control-plane.sh's output for `argv` (stripped); raises if it fails."""
    return subprocess.run(
        [str(ROOT / "hack" / "control-plane.sh"), *argv], capture_output=True, text=True, check=True
    ).stdout.strip()


def tf_job(
    name: str,
    *,
    roles: Mapping[str, int],
    template: Mapping[str, Any],
    namespace: str | None = None,
) -> dict[str, Any]:
    """A TFJob with `roles` (jaxps's role names and replica counts), every pod of `template`,
    none restarted (as the benches' TrainingJobs)."""
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": metadata,
        "spec": {
            "tfReplicaSpecs": {
                TF_KINDS[role]: {"replicas": n, "restartPolicy": "Never", "template": template}
                for role, n in roles.items()
            }
        },
    }
