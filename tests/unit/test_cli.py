"""The `jaxps` command's words: whole lines in logs and pipes, no number before there is one."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from jaxps_operator import cli

ROOT = Path(__file__).resolve().parents[2]
MNIST = yaml.safe_load((ROOT / "examples" / "mnist.yaml").read_text())


def test_validate_names_every_misspelt_training_field_on_one_line_each_in_a_pipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job: dict[str, Any] = copy.deepcopy(MNIST)
    job["metadata"]["name"] = "a-long-name-to-push-lines-past-80-columns"
    job["spec"]["training"]["model"] = {"name": "resnet"}
    job["spec"]["training"]["optimizer"] = {"name": "sgdd"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(job))
    assert cli.main(["validate", str(path)]) == cli.EXIT_INVALID
    lines = capsys.readouterr().err.splitlines()
    model = [line for line in lines if "spec.training.model.name" in line]
    optimizer = [line for line in lines if "spec.training.optimizer.name" in line]
    assert len(model) == 1
    assert '"resnet"' in model[0]
    assert "linear, mlp, embedding" in model[0]
    assert len(optimizer) == 1
    assert '"sgdd"' in optimizer[0]
    assert "adam" in optimizer[0]
    assert "sgd" in optimizer[0].split('"sgdd"', 1)[1]  # the allowed names, on the same line


def test_the_progress_line_shows_no_loss_before_the_first_step() -> None:
    job: dict[str, Any] = copy.deepcopy(MNIST)
    job["status"] = {"progress": {"step": 0}}
    assert cli.progress_line(job) == "step 0/600"
    job["status"] = {"progress": {"step": 10, "loss": 0.5, "stepsPerSecond": 12.0}}
    assert cli.progress_line(job) == "step 10/600  loss 0.5000  12.0 steps/s"
