"""The user's own training loop on a real node: the TF1 trainer ported line by line
(`examples/tf1-mnist.yaml`, `training.program`) and the GAN (`examples/gan.yaml`), each with its
program on a volume every pod mounts and on PYTHONPATH, run to Succeeded by the operator."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.cluster.harness import ROOT
from tests.e2e.harness import E2eJobs, keep, manifest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROGRAMS = ROOT / "examples" / "programs"


def _with_program(jobs: E2eJobs, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with examples/programs on a volume at /programs, on every pod's PYTHONPATH."""
    name = body["metadata"]["name"]
    volume = jobs.checkpoint_claim(f"{name}-programs")
    for source in PROGRAMS.glob("*.py"):
        shutil.copy(source, volume / source.name)
        (volume / source.name).chmod(0o644)
    template = {
        "spec": {
            "volumes": [
                {
                    "name": "programs",
                    "persistentVolumeClaim": {"claimName": f"{name}-programs", "readOnly": True},
                }
            ],
            "containers": [
                {
                    "name": "jaxps",
                    "env": [{"name": "PYTHONPATH", "value": "/programs"}],
                    "volumeMounts": [
                        {"name": "programs", "mountPath": "/programs", "readOnly": True}
                    ],
                }
            ],
        }
    }
    for replica in body["spec"]["replicaSpecs"].values():
        replica["template"] = template
    return body


def test_the_ported_tf1_trainer_runs_to_succeeded_and_learns(jobs: E2eJobs) -> None:
    body = manifest(ROOT / "examples" / "tf1-mnist.yaml")
    body["spec"]["training"]["dataset"] = {"name": "digits"}
    jobs.apply(_with_program(jobs, body))
    job = jobs.wait_done(body["metadata"]["name"])
    progress = job["status"]["progress"]
    assert progress["step"] == body["spec"]["training"]["steps"]
    assert progress["eval"]["accuracy"] >= 0.9, progress
    keep(f"tf1-mnist: {progress}\n", "program-tf1.txt")


def test_the_gan_trains_its_two_networks_to_succeeded(jobs: E2eJobs) -> None:
    body = manifest(ROOT / "examples" / "gan.yaml")
    jobs.apply(_with_program(jobs, body))
    job = jobs.wait_done(body["metadata"]["name"])
    progress = job["status"]["progress"]
    assert progress["step"] == body["spec"]["training"]["steps"]
    assert progress["eval"]["mean_error"] < 1.0, progress
    keep(f"gan: {progress}\n", "program-gan.txt")
