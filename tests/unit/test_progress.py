"""status.progress: the chief's metrics while it runs, its final summary once it has ended."""

from __future__ import annotations

import json

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


def test_the_final_summary_completes_the_progress_and_drops_missing_evals() -> None:
    before = {"step": 580, "loss": 0.2, "stepsPerSecond": 99.0, "lastCheckpointStep": 500}
    assert progress.final(before, DONE) == {
        "step": 600,
        "loss": 0.01,
        "stepsPerSecond": 120.5,
        "lastCheckpointStep": 600,
        "eval": {"accuracy": 0.97},
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
