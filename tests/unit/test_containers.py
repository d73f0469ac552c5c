"""The container jaxps runs in is found by its name (`jaxps`) wherever the template lists it;
the user's other containers, init containers and native sidecars keep what they are, and the
task's end is the jaxps container's, even while a sidecar still runs."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from jaxps_operator import builders, kube, schema
from jaxps_operator.objects import PodState
from jaxps_operator.policy import cleanup, restart
from tests.unit.test_planner import NOW, job, pods, step
from tests.unit.test_reconcile import Memory, Pass, manifest

SIDECAR = {"name": "log-shipper", "image": "busybox:1.36", "command": ["sleep", "infinity"]}
NATIVE = {**SIDECAR, "name": "proxy", "restartPolicy": "Always"}


def _job(containers: list[dict[str, Any]], **init: Any) -> dict[str, Any]:
    m = manifest()
    m["spec"]["replicaSpecs"]["worker"]["template"] = {"spec": {"containers": containers, **init}}
    return m


def test_a_sidecar_listed_first_keeps_its_image_and_jaxps_gets_its_own() -> None:
    j = schema.validate(
        _job(
            [SIDECAR, {"name": "jaxps", "env": [{"name": "A", "value": "1"}]}],
            initContainers=[NATIVE],
        )
    )
    pod = builders.pod(j, "worker", 1, network=builders.dns_network(j))
    sidecar, main = pod["spec"]["containers"]
    assert sidecar == SIDECAR  # untouched: no env, ports, probes or mounts of jaxps
    assert main["name"] == "jaxps"
    assert main["image"] == builders.DEFAULT_IMAGE
    assert main["command"] == ["python", "-m", "jaxps_runtime"]
    env = {e["name"] for e in main["env"]}
    assert {"A", "TF_CONFIG", "JAXPS_TRAINING", "JAXPS_TLS_DIR"} <= env
    assert {p["name"] for p in main["ports"]} == {"grpc", "metrics"}
    assert pod["spec"]["initContainers"] == [NATIVE]


def test_a_templates_only_container_runs_jaxps_whatever_its_name() -> None:
    j = schema.validate(_job([{"name": "tensorflow"}]))
    pod = builders.pod(j, "worker", 0, network=builders.dns_network(j))
    [main] = pod["spec"]["containers"]
    assert main["name"] == "tensorflow"
    assert main["image"] == builders.DEFAULT_IMAGE


def test_several_containers_and_none_named_jaxps_is_refused_naming_the_field() -> None:
    with pytest.raises(schema.InvalidManifestError) as err:
        schema.load(
            "\n".join(
                [
                    "apiVersion: jaxps.dev/v1alpha1",
                    "kind: TrainingJob",
                    "metadata: {name: tj}",
                    "spec:",
                    "  replicaSpecs:",
                    "    ps: {replicas: 1}",
                    "    worker:",
                    "      replicas: 1",
                    "      template:",
                    "        spec:",
                    "          containers: [{name: main}, {name: log-shipper, image: busybox}]",
                    "  training: {steps: 10}",
                ]
            )
        )
    said = str(err.value)
    assert "spec.replicaSpecs.worker.template.spec.containers" in said
    assert '2 containers ("main", "log-shipper") and none named "jaxps"' in said


def test_the_operator_fails_such_a_job_invalid_template_and_starts_no_pod() -> None:
    memory = Memory(_job([{"name": "main"}, SIDECAR]))
    Pass(memory)()
    assert memory.created == []
    assert memory.job is not None
    assert memory.job["status"]["state"] == "Failed"
    failed = next(c for c in memory.job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidTemplate"
    assert "none named" in failed["message"]


def test_a_bad_setting_is_named_in_the_jaxps_containers_env_wherever_it_is_listed() -> None:
    m = _job([SIDECAR, {"name": "jaxps", "env": [{"name": "JAXPS_BULK", "value": "maybe"}]}])
    [problem] = schema.setting_problems(schema.validate(m))
    assert problem.path == "spec.replicaSpecs.worker.template.spec.containers[1].env[0].value"


def _pod(phase: str, main_state: dict[str, Any], sidecar_state: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "tj-worker-1",
            "labels": {"jaxps.dev/replica-type": "worker", "jaxps.dev/replica-index": "1"},
            "ownerReferences": [{"uid": "u"}],
        },
        "spec": {"containers": [SIDECAR, {"name": "jaxps"}]},
        "status": {
            "phase": phase,
            "containerStatuses": [
                {"name": "log-shipper", "state": sidecar_state},
                {"name": "jaxps", "state": main_state},
            ],
        },
    }


@pytest.mark.parametrize(("code", "phase"), [(0, "Succeeded"), (3, "Failed")])
def test_the_jaxps_container_ended_while_a_sidecar_runs_ends_the_task(
    code: int, phase: str
) -> None:
    ended = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
    state = kube.pod_state(_pod("Running", ended, {"running": {}}), "u")
    assert state is not None
    assert (state.phase, state.exit_code) == (phase, code)
    assert state.metrics is None  # no metrics read from a task that ended


def test_a_pod_being_deleted_whose_container_ended_is_leaving_not_done() -> None:
    """A preempted job's pods are deleted: the chief's container ending on SIGTERM while the
    pod is still Running was read as the task's end, and the job Succeeded."""
    going = _pod("Running", {"terminated": {"exitCode": 0, "reason": "Completed"}}, {"running": {}})
    going["metadata"]["deletionTimestamp"] = "2026-11-29T08:00:45Z"
    state = kube.pod_state(going, "u")
    assert state is not None
    assert (state.phase, state.deleting, state.lingering) == ("Running", True, False)


def test_a_sidecar_that_ended_is_not_taken_for_the_task() -> None:
    ended = {"terminated": {"exitCode": 1, "reason": "Error"}}
    state = kube.pod_state(_pod("Running", {"running": {}}, ended), "u")
    assert state is not None
    assert (state.phase, state.exit_code, state.container_reason) == ("Running", None, "")
    slim = kube.slim_pod(_pod("Running", {"running": {}}, ended))
    assert slim["spec"]["containers"] == [{"name": "jaxps"}]


def test_an_oom_advice_names_the_jaxps_containers_field() -> None:
    j = schema.validate(_job([SIDECAR, {"name": "jaxps"}]))
    pod = PodState(name="tj-worker-1", role="worker", index=1, phase="Failed", exit_code=137)
    assert "template.spec.containers[1].resources.limits.memory" in restart.oom_advice(j, pod)


def test_a_pod_a_sidecar_keeps_running_after_the_job_succeeded_goes_after_the_grace() -> None:
    j = job(ps=1, workers=1)
    step(j, pods(j))
    [ps, worker] = pods(j, worker0=("Succeeded", 0))
    ended = [ps, dataclasses.replace(worker, lingering=True)]  # its sidecar still runs
    result = step(j, ended)
    assert result.status["state"] == "Succeeded"
    assert result.delete == []  # the grace: they may end on their own, their logs kept
    over = step(j, ended, NOW + timedelta(seconds=cleanup.RUNNING_GRACE_SECONDS))
    assert sorted(over.delete) == ["tj-ps-0", "tj-worker-0"]


def test_a_pod_of_the_jobs_name_that_is_someone_elses_fails_the_job_name_taken_untouched() -> None:
    j = job(ps=1, workers=2)
    step(j, pods(j))
    [ps, worker0, worker1] = pods(j)
    theirs = dataclasses.replace(worker1, deleting=True, foreign=True)
    result = step(j, [ps, worker0, theirs])
    assert result.status["state"] == "Failed"
    failed = next(c for c in result.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NameTaken"
    assert failed["message"].startswith(f"Pod {worker1.name} holds a name this job needs")
    assert worker1.name not in result.delete  # never deleted
    assert [m for m in result.create if m["metadata"]["name"] == worker1.name] == []


@pytest.mark.parametrize(
    ("refs", "ours"),
    [
        ([{"uid": "u-1", "kind": "TrainingJob", "name": "tj"}], True),
        ([], False),
        ([{"uid": "u-0", "kind": "TrainingJob", "name": "tj", "controller": True}], False),
        ([{"uid": "r-1", "kind": "ReplicaSet", "name": "web"}], False),
    ],
    ids=["the-jobs", "nobodys", "an-earlier-job-of-the-name", "a-replicasets"],
)
def test_an_object_is_the_jobs_only_with_its_uid_among_its_owners(
    refs: list[dict[str, Any]], ours: bool
) -> None:
    why = kube.foreign({"metadata": {"ownerReferences": refs}}, {"metadata": {"uid": "u-1"}})
    assert (why is None) is ours
    if refs and not ours:
        assert why is not None
        assert f"(its owner: {refs[0]['kind']} {refs[0]['name']})" in why


def test_a_pod_of_an_earlier_job_of_the_name_is_going_not_someone_elses() -> None:
    earlier = _pod("Running", {"running": {}}, {"running": {}})
    earlier["metadata"]["ownerReferences"] = [
        {"uid": "old", "kind": "TrainingJob", "controller": True}
    ]
    state = kube.pod_state(earlier, "new")
    assert state is not None
    assert (state.deleting, state.foreign) == (True, False)
    nobodys = _pod("Running", {"running": {}}, {"running": {}})
    nobodys["metadata"]["ownerReferences"] = []
    state = kube.pod_state(kube.slim_pod(nobodys), "new")
    assert state is not None
    assert (state.deleting, state.foreign) == (True, True)


def test_a_user_dataset_given_a_name_as_well_is_told_to_leave_the_name_out() -> None:
    m = manifest(training={"steps": 10, "dataset": {"name": "clicks", "module": "mine.data:load"}})
    with pytest.raises(schema.InvalidManifestError) as err:
        schema.validate(m)
    said = str(err.value)
    assert 'spec.training.dataset.name: Unsupported value: "clicks"' in said
    assert "for your own, set module and leave name out" in said
