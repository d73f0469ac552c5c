"""status.progress: the chief's metrics while it runs, its final summary once it has ended."""

from __future__ import annotations

import json
from typing import Any

from jaxps_operator import controller, progress

DONE = {
    "event": "done",
    "step": 600,
    "loss": 0.01,
    "eval": {"accuracy": 0.97, "loss": None},
    "stepsPerSecond": 120.5,
    "lastCheckpointStep": 600,
}


def chief_pod(phase: str, message: str | None = None) -> dict[str, Any]:
    state = {"terminated": {"exitCode": 0, "message": message}} if message else {"running": {}}
    return {
        "metadata": {"name": "mnist-worker-0"},
        "spec": {
            "containers": [{"name": "jaxps", "ports": [{"name": "metrics", "containerPort": 1}]}]
        },
        "status": {"phase": phase, "containerStatuses": [{"state": state}]},
    }


def test_the_summary_is_the_last_done_line_of_a_log() -> None:
    log = "starting\n" + json.dumps({**DONE, "step": 1}) + "\nnoise\n" + json.dumps(DONE) + "\n"
    assert progress.summary(log) == DONE


def test_no_summary_in_text_without_one_or_with_a_broken_one() -> None:
    assert progress.summary(None) is None
    assert progress.summary("step 3/600 loss 0.2") is None
    assert progress.summary('{"event": "done", "step":') is None


def test_the_final_summary_completes_the_progress_and_drops_missing_evals() -> None:
    before = {"step": 580, "loss": 0.2, "stepsPerSecond": 99.0, "lastCheckpointStep": 500}
    assert progress.final(before, DONE) == {
        "step": 600,
        "loss": 0.01,
        "stepsPerSecond": 120.5,
        "lastCheckpointStep": 600,
        "eval": {"accuracy": 0.97},
    }


def test_a_succeeded_chief_gives_its_termination_message_as_the_final_progress() -> None:
    pod = chief_pod("Succeeded", json.dumps(DONE) + "\n")
    out = controller.Reconciler._progress(pod, {"step": 590})
    assert out["step"] == 600
    assert out["eval"] == {"accuracy": 0.97}


def test_a_failed_or_pending_chief_leaves_the_progress_as_it_was() -> None:
    for phase in ("Failed", "Pending"):
        assert controller.Reconciler._progress(chief_pod(phase), {"step": 7}) == {"step": 7}
