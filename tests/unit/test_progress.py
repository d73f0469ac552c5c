"""status.progress: the chief's metrics while it runs, its final summary once it has ended."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta

import pytest

from jaxps_operator import kube, progress
from jaxps_operator.objects import PodState

DONE = {
    "event": "done",
    "step": 600,
    "loss": 0.01,
    "eval": {"accuracy": 0.97, "loss": None},
    "stepsPerSecond": 120.5,
    "lastCheckpointStep": 600,
}
METRICS = {
    "jaxps_global_step": 42.0,
    "jaxps_loss": 0.5,
    "jaxps_steps_per_second": 10.123,
    "jaxps_last_checkpoint_step": 40.0,
}


def chief(phase: str, message: str = "") -> PodState:
    return PodState("mnist-worker-0", "worker", 0, phase, exit_code=0, message=message)


def test_the_summary_is_the_last_done_line_of_a_log() -> None:
    log = "starting\n" + json.dumps({**DONE, "step": 1}) + "\nnoise\n" + json.dumps(DONE) + "\n"
    assert progress.summary(log) == DONE


def test_no_summary_in_text_without_one_or_with_a_broken_one() -> None:
    assert progress.summary(None) is None
    assert progress.summary("step 3/600 loss 0.2") is None
    assert progress.summary('{"event": "done", "step":') is None


def test_the_final_summary_completes_the_progress_and_names_evals_that_are_not_finite() -> None:
    before = {"step": 580, "loss": 0.2, "stepsPerSecond": 99.0, "lastCheckpointStep": 500}
    assert progress.final(before, DONE) == {
        "step": 600,
        "loss": 0.01,
        "stepsPerSecond": 120.5,
        "lastCheckpointStep": 600,
        "eval": {"accuracy": 0.97},
        "note": "the evaluation's loss was not finite",
    }


def test_a_running_chief_gives_its_metrics() -> None:
    out = progress.update({}, chief=chief("Running"), metrics=METRICS)
    assert out == {"step": 42, "loss": 0.5, "stepsPerSecond": 10.12, "lastCheckpointStep": 40}


def test_an_ended_chief_gives_its_termination_message_as_the_final_progress() -> None:
    out = progress.update(
        {"step": 590}, chief=chief("Succeeded", json.dumps(DONE) + "\n"), metrics={}
    )
    assert out["step"] == 600
    assert out["eval"] == {"accuracy": 0.97}


def test_a_failed_or_pending_chief_leaves_the_progress_as_it_was() -> None:
    for phase in ("Failed", "Pending"):
        assert progress.update({"step": 7}, chief=chief(phase), metrics={}) == {"step": 7}


def test_a_kubernetes_chief_pod_yields_its_termination_message_and_metrics_address() -> None:
    pod = {
        "metadata": {
            "name": "mnist-worker-0",
            "labels": {"jaxps.dev/replica-type": "worker", "jaxps.dev/replica-index": "0"},
            "ownerReferences": [{"uid": "u"}],
        },
        "spec": {
            "containers": [{"name": "jaxps", "ports": [{"name": "metrics", "containerPort": 9191}]}]
        },
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {
                    "name": "jaxps",
                    "state": {"terminated": {"exitCode": 0, "message": json.dumps(DONE)}},
                }
            ],
        },
    }
    state = kube.pod_state(pod, "u")
    assert state is not None
    assert progress.update({}, chief=state, metrics={})["eval"] == {"accuracy": 0.97}
    running = {**pod, "status": {"phase": "Running", "podIP": "10.88.0.7"}}
    assert kube.pod_state(running, "u").metrics == "10.88.0.7:9191"  # type: ignore[union-attr]


def test_no_loss_is_reported_before_the_first_step() -> None:
    out = progress.update(
        {}, chief=chief("Running"), metrics={"jaxps_global_step": 0.0, "jaxps_loss": 0.0}
    )
    assert "loss" not in out
    assert out["step"] == 0


def test_no_last_checkpoint_step_is_reported_while_there_is_none() -> None:
    off = {**METRICS, "jaxps_last_checkpoint_step": 0.0}
    assert "lastCheckpointStep" not in progress.update({}, chief=chief("Running"), metrics=off)
    del off["jaxps_last_checkpoint_step"]
    assert "lastCheckpointStep" not in progress.update({}, chief=chief("Running"), metrics=off)
    # an older operator's 0 goes too; a real one stays
    assert "lastCheckpointStep" not in progress.merge({"lastCheckpointStep": 0}, off)
    assert progress.merge({"lastCheckpointStep": 40}, off)["lastCheckpointStep"] == 40
    done = {**DONE, "lastCheckpointStep": 0}
    assert "lastCheckpointStep" not in progress.final({}, done)


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_loss_is_null_with_a_note_and_the_progress_strict_json(loss: float) -> None:
    metrics = {**METRICS, "jaxps_loss": loss, "eval/accuracy": math.nan}
    out = progress.update({"loss": 0.4}, chief=chief("Running"), metrics=metrics)
    assert out["loss"] is None
    assert out["note"] == (
        f"the loss at step 42 was not finite ({loss}); the evaluation's accuracy was not finite"
    )
    assert "eval" not in out
    json.dumps(out, allow_nan=False)  # what the API server takes
    finite = progress.merge(out, METRICS)
    assert finite["loss"] == 0.5
    assert "note" not in finite
    final = progress.final({}, {**DONE, "loss": loss})
    assert final["loss"] is None
    assert "not finite" in final["note"]
    json.dumps(final, allow_nan=False)


def test_step_time_is_when_the_step_last_moved() -> None:
    t0 = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    first = progress.merge({}, METRICS, now=t0)
    assert first["stepTime"] == "2026-11-21T12:00:00Z"
    same = progress.merge(first, METRICS, now=t0 + timedelta(seconds=30))
    assert same["stepTime"] == "2026-11-21T12:00:00Z"
    moved = progress.merge(
        same, {**METRICS, "jaxps_global_step": 43.0}, now=t0 + timedelta(seconds=40)
    )
    assert moved["stepTime"] == "2026-11-21T12:00:40Z"


def test_an_evaluation_metric_that_is_not_finite_is_named_in_the_note() -> None:
    """A test set with NaN features: the eval loss was NaN, and it vanished from the status
    without a word."""
    done = {"event": "done", "step": 60, "loss": 0.5, "eval": {"accuracy": 0.0, "loss": None}}
    final = progress.final({}, done)
    assert final["eval"] == {"accuracy": 0.0}
    assert final["note"] == "the evaluation's loss was not finite"
    merged = progress.merge(
        {}, {"jaxps_global_step": 5.0, "jaxps_loss": 0.5, "eval/loss": float("nan")}
    )
    assert "eval" not in merged
    assert merged["note"] == "the evaluation's loss was not finite"


def test_the_final_summary_gives_each_dynamic_table_with_finite_numbers_only() -> None:
    table = {"resident": 10, "maxRows": 20, "admitted": 12, "evicted": 2, "lookups": 99}
    done = {
        **DONE,
        "embeddings": {
            "items": {**table, "hitRate": 0.5, "extra": 1},
            "users": {"hitRate": math.nan},  # nothing finite: left out
            "bad": "not a table",
        },
    }
    out = progress.final({}, done)
    assert out["embeddings"] == {"items": {**table, "hitRate": 0.5}}
    assert "embeddings" not in progress.final({}, DONE)
