"""The `jaxps` command's words: whole lines in logs and pipes, no number before there is one."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from jaxps_operator import cli, local, schema

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


def with_progress(**progress: Any) -> dict[str, Any]:
    job: dict[str, Any] = copy.deepcopy(MNIST)
    job["status"] = {"progress": progress}
    return job


def test_the_progress_line_shows_no_loss_before_the_first_step() -> None:
    assert cli.progress_line(with_progress(step=0)) == "step 0/600 (0%)"
    assert cli.progress_line(with_progress(step=10, loss=0.5, stepsPerSecond=12.0)) == (
        "step 10/600 (1%)  loss 0.5000  12.0 steps/s  ETA 49s"
    )


@pytest.mark.parametrize(
    "loss",
    [None, math.nan, math.inf, "0.5"],
    ids=["null-with-a-note", "nan", "infinity", "a-string"],
)
def test_the_progress_line_shows_no_loss_that_is_not_a_finite_number(loss: Any) -> None:
    job = with_progress(step=120, loss=loss, note="loss was not finite")
    assert cli.progress_line(job) == "step 120/600 (20%)"


def test_the_progress_line_shows_the_share_done_the_eta_at_the_recent_rate_and_accuracy() -> None:
    job = with_progress(
        step=300, loss=0.25, stepsPerSecond=1.0, eval={"loss": 0.3, "accuracy": 0.912345}
    )
    # the recent rate (20 steps/s), not the chief's mean: 300 steps left take 15 s
    assert cli.progress_line(job, rate=20.0) == (
        "step 300/600 (50%)  loss 0.2500  20.0 steps/s  ETA 15s  eval accuracy 0.9123"
    )
    assert "ETA 5m00s" in cli.progress_line(job)  # no recent rate yet: the chief's mean
    job["status"]["progress"]["eval"] = {"loss": 0.3}
    assert cli.progress_line(job, rate=20.0).endswith("eval loss 0.3000")  # no accuracy


def test_the_progress_line_of_a_step_standing_still_shows_no_speed_and_no_eta() -> None:
    """A ps paused: the step stands, and the chief's mean (187 steps/s) would read as if it
    still ran, with an ETA that never moves."""
    job = with_progress(step=300, loss=0.25, stepsPerSecond=187.0)
    assert cli.progress_line(job, rate=0.0) == "step 300/600 (50%)  loss 0.2500  0.0 steps/s"


def test_words_in_brackets_are_printed_as_they_are_never_read_as_markup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path (or a user's exception) with `[/x]` in it crashed the command with rich's
    MarkupError; `[bold]x` lost its brackets."""
    missing = tmp_path / "no[/x][bold]file.yaml"
    assert cli.main(["validate", str(missing)]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert f"{missing}: cannot read it" in err.replace("\n", "")
    under_file = tmp_path / "afile"
    under_file.write_text("")
    example = Path(__file__).resolve().parents[2] / "examples" / "mnist.yaml"
    assert cli.main(["local", str(example), "--workdir", str(under_file / "[/x]")]) == (
        cli.EXIT_INVALID
    )
    assert "[/x]" in capsys.readouterr().err


def test_the_progress_line_of_a_finished_job_has_no_eta() -> None:
    job = with_progress(step=600, loss=0.1, stepsPerSecond=40.0, eval={"accuracy": 0.97})
    assert cli.progress_line(job) == (
        "step 600/600 (100%)  loss 0.1000  40.0 steps/s  eval accuracy 0.9700"
    )


def test_the_recent_rate_forgets_old_steps_and_starts_again_after_a_rollback() -> None:
    rate = cli.RecentRate(window=10.0)
    rate.observe(0.0, 0)
    assert rate.per_second() is None  # one sample
    rate.observe(0.5, 0)
    assert rate.per_second() is None  # less than a second
    for second in range(1, 31):  # 1 step/s for 10 s, then 10 steps/s
        rate.observe(float(second), second if second <= 10 else 10 + 10 * (second - 10))
    assert rate.per_second() == pytest.approx(10.0, rel=0.02)
    rate.observe(31.0, 50)  # a rollback: the step went back
    rate.observe(32.5, 65)
    assert rate.per_second() == pytest.approx(10.0)


def test_json_output_is_strict_a_nan_loss_is_null_with_a_note() -> None:
    status: dict[str, Any] = {
        "state": "Failed",
        "progress": {"step": 40, "loss": math.nan, "eval": {"accuracy": math.inf, "loss": 0.5}},
    }
    text = local.strict_json(status, sort_keys=True)
    # what any JSON parser takes: no NaN or Infinity tokens
    strict = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))
    assert strict["progress"]["loss"] is None
    assert strict["progress"]["eval"] == {"accuracy": None, "loss": 0.5}
    assert strict["progress"]["note"] == "loss, eval.accuracy were not finite"
    assert status["progress"]["loss"] != status["progress"]["loss"]  # the status is untouched
    note = {"progress": {"loss": math.nan, "note": "waiting for the chief"}}
    assert local.finite(note)["progress"]["note"] == "waiting for the chief; loss was not finite"
    assert local.finite({"progress": {"step": 3}}) == {"progress": {"step": 3}}  # no note


def test_two_default_work_directories_made_in_the_same_second_differ(tmp_path: Path) -> None:
    root = tmp_path / ".work"
    now = 1_790_000_000.0
    first = local.default_workdir("mnist", root=root, now=now)
    second = local.default_workdir("mnist", root=root, now=now)
    assert first != second
    assert first.is_dir()
    assert second.is_dir()
    assert second.name == f"{first.name}-2"


@pytest.mark.parametrize("case", ["a-file", "under-a-file", "read-only"])
def test_a_workdir_that_cannot_hold_the_job_exits_2_naming_the_flag_path_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    manifest = tmp_path / "mnist.yaml"
    manifest.write_text(yaml.safe_dump(MNIST))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    if case == "a-file":
        workdir, why = blocker, "it is a file, not a directory"
    elif case == "under-a-file":
        workdir, why = blocker / "work", f"{blocker} is a file"
    elif os.geteuid() != 0:
        workdir = tmp_path / "read-only"
        workdir.mkdir(mode=0o500)
        why = "cannot write in it"
    else:  # root writes in any directory, but not in sysfs
        workdir, why = Path("/sys/jaxps-workdir"), "cannot create it"
    code = cli.main(["local", str(manifest), "--workdir", str(workdir)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INVALID
    assert f"--workdir {workdir}" in err
    assert why in err
    assert "Traceback" not in err


def test_a_kill_past_the_last_step_is_refused_naming_the_flag_value_and_the_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "mnist.yaml"
    manifest.write_text(yaml.safe_dump(MNIST))
    workdir = tmp_path / "work"
    code = cli.main(["local", str(manifest), "--workdir", str(workdir), "--kill", "ps-0@step=601"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INVALID
    assert "--kill 'ps-0@step=601'" in err
    assert "past the job's last step 600" in err
    assert "0..600" in err
    assert not workdir.exists()  # refused before anything was made
    job = schema.load(yaml.safe_dump(MNIST))
    assert local.Kill.parse("ps-0@step=600", job=job) == local.Kill("mnist-ps-0", 600)
