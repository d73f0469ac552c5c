"""The planner, table by table: every policy path and every condition reason."""

from __future__ import annotations

import copy
import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jaxps_operator import builders, planner, schema
from jaxps_operator.planner import PodState
from jaxps_operator.policy import cleanup, schedule
from jaxps_runtime.config import cluster

NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)


def job(
    *,
    chief: int = 0,
    ps: int = 1,
    workers: int = 2,
    evaluator: int = 0,
    policy: str = "OnFailure",
    run: dict[str, Any] | None = None,
    success: str = "chief",
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    specs: dict[str, Any] = {"worker": {"replicas": workers, "restartPolicy": policy}}
    if chief:
        specs["chief"] = {"replicas": chief, "restartPolicy": policy}
    if ps:
        specs["ps"] = {"replicas": ps, "restartPolicy": policy}
    if evaluator:
        specs["evaluator"] = {"replicas": evaluator, "restartPolicy": policy}
    manifest = {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "tj", "namespace": "ns", "uid": "u-1", "generation": 3},
        "spec": {
            "replicaSpecs": specs,
            "training": {"steps": 10},
            "runPolicy": run or {},
            "successPolicy": success,
        },
    }
    validated = schema.validate(manifest)
    validated["status"] = copy.deepcopy(status or {})
    return validated


# What a task that trained to the end leaves in its termination log (the chief's summary)
DONE = '{"event": "done", "step": 10}'


def pods(
    j: dict[str, Any], phase: str = "Running", /, **overrides: tuple[str, int | None]
) -> list[PodState]:
    """Every pod of the job in `phase`; overrides: name=(phase, exit code). A pod that
    Succeeded with exit 0 holds the final summary, as the runtime's chief writes it."""
    out = []
    for role, count in builders.replicas(j).items():
        for index in range(count):
            name = f"{role}{index}"
            ph, code = overrides.get(name, (phase, None))
            out.append(
                PodState(
                    name=builders.pod_name(j, role, index),
                    role=role,
                    index=index,
                    phase=ph,
                    ready=ph == "Running",
                    exit_code=code,
                    message=DONE if (ph, code) == ("Succeeded", 0) else "",
                )
            )
    return out


def cond(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def step(
    j: dict[str, Any], observed: list[PodState], now: datetime = NOW, **kw: Any
) -> planner.Plan:
    """Plans, and carries the status over as a backend would."""
    kw.setdefault("network", builders.dns_network(j))
    result = planner.plan(j, observed, now, **kw)
    j["status"] = result.status
    return result


def test_a_new_job_gets_its_service_and_every_pod() -> None:
    j = job(chief=1, ps=2, workers=2, evaluator=1)
    result = step(j, [], service_exists=False)
    kinds = [c["kind"] for c in result.create]
    assert kinds == ["Service"] + ["Pod"] * 6
    svc = result.create[0]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["name"] == "tj"
    assert cond(result.status, "Created")["reason"] == "JobCreated"  # type: ignore[index]
    assert result.status["state"] == "Created"
    assert result.status["observedGeneration"] == 3
    assert [e.reason for e in result.events] == ["JobCreated"]


def test_pods_carry_names_labels_owner_port_and_tf_config_of_dns_names() -> None:
    j = job(ps=2, workers=2)
    created = {c["metadata"]["name"]: c for c in step(j, []).create if c["kind"] == "Pod"}
    p = created["tj-ps-1"]
    assert p["metadata"]["labels"] == {
        builders.LABEL_JOB: "tj",
        builders.LABEL_ROLE: "ps",
        builders.LABEL_INDEX: "1",
    }
    assert p["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert (p["spec"]["hostname"], p["spec"]["subdomain"]) == ("tj-ps-1", "tj")
    assert p["spec"]["restartPolicy"] == "Never"
    main = p["spec"]["containers"][0]
    assert {"name": "grpc", "containerPort": 2222} in main["ports"]
    env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
    tf = cluster.parse_tf_config(env["TF_CONFIG"])
    assert tf.task == cluster.TaskSpec("ps", 1)
    # the metrics and health port listens on the pod's own address, from the downward API
    assert {
        "name": "JAXPS_POD_IP",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    } in main["env"]
    assert tf.cluster.addresses("worker") == (
        "tj-worker-0.tj.ns.svc:2222",
        "tj-worker-1.tj.ns.svc:2222",
    )
    assert json.loads(env["JAXPS_TRAINING"])["steps"] == 10
    assert (env["JAXPS_JOB_NAME"], env["JAXPS_JOB_UID"], env["JAXPS_METRICS_PORT"]) == (
        "tj",
        "u-1",
        "9090",
    )


def test_running_and_pods_ready_follow_the_pods() -> None:
    j = job()
    step(j, [])
    pending = [PodState(p.name, p.role, p.index, "Pending") for p in pods(j)]
    result = step(j, pending)
    assert cond(result.status, "Running") is None
    assert result.status["replicaStatuses"]["worker"]["pending"] == 2
    result = step(j, pods(j))
    assert cond(result.status, "Running")["reason"] == "JobRunning"  # type: ignore[index]
    assert cond(result.status, "PodsReady")["status"] == "True"  # type: ignore[index]
    assert result.status["readyReplicas"] == "3/3"
    # counts of 0, and a progress with nothing in it yet, are left out (each stored field
    # makes every status write cost the API server more)
    assert result.status["replicaStatuses"] == {
        "ps": {"active": 1, "ready": 1},
        "worker": {"active": 2, "ready": 2},
    }
    assert "progress" not in result.status
    assert result.status["state"] == "Running"
    assert result.create == []


@pytest.mark.parametrize(
    ("policy", "code", "replaced"),
    [
        ("OnFailure", 1, True),
        ("Always", 1, True),
        ("ExitCode", 137, True),
        ("ExitCode", 143, True),
        ("ExitCode", 1, False),
        ("Never", 137, False),
        ("Never", 1, False),
    ],
    ids=[
        "on-failure",
        "always",
        "exit-code-137",
        "exit-code-143",
        "exit-code-1",
        "never-137",
        "never-1",
    ],
)
def test_a_failed_pod_is_replaced_or_fails_the_job_by_its_policy(
    policy: str, code: int, replaced: bool
) -> None:
    j = job(policy=policy)
    step(j, pods(j))
    result = step(j, pods(j, worker1=("Failed", code)))
    if replaced:
        assert result.delete == ["tj-worker-1"]
        assert result.status["restarts"] == 1
        assert result.status["replicaStatuses"]["worker"]["restarts"] == 1
        assert cond(result.status, "Restarting")["reason"] == "PodReplaced"  # type: ignore[index]
        assert result.status["state"] == "Restarting"
        assert "PodReplaced" in [e.reason for e in result.events]
    else:
        failed = cond(result.status, "Failed")
        assert failed is not None
        assert failed["reason"] == "ReplicaFailed"
        assert f"worker 1 (pod tj-worker-1) failed with exit code {code}" in failed["message"]
        assert f"restartPolicy is {policy}" in failed["message"]
        assert result.status["state"] == "Failed"
        assert sorted(result.delete) == ["tj-ps-0", "tj-worker-0"]  # no ps outlives its job


def test_a_pod_is_never_recreated_while_its_predecessor_terminates() -> None:
    j = job()
    step(j, pods(j))
    step(j, pods(j, worker1=("Failed", 1)))
    terminating = [
        p
        if p.name != "tj-worker-1"
        else PodState(p.name, p.role, p.index, "Failed", exit_code=1, deleting=True)
        for p in pods(j)
    ]
    result = step(j, terminating)
    assert result.create == []
    assert result.status["restarts"] == 1  # not counted twice
    gone = [p for p in pods(j) if p.name != "tj-worker-1"]
    result = step(j, gone)
    assert [c["metadata"]["name"] for c in result.create] == ["tj-worker-1"]
    # the replacement exists but does not run yet: still Restarting
    pending = step(j, pods(j, worker1=("Pending", None)))
    assert cond(pending.status, "Restarting")["status"] == "True"  # type: ignore[index]
    assert pending.status["state"] == "Restarting"
    back = step(j, pods(j))
    assert cond(back.status, "Restarting")["status"] == "False"  # type: ignore[index]
    assert cond(back.status, "Restarting")["reason"] == "PodsReplaced"  # type: ignore[index]


def test_the_backoff_limit_counts_every_replacement_in_status_and_no_other() -> None:
    j = job(run={"backoffLimit": 1})
    step(j, pods(j))
    step(j, pods(j, worker1=("Failed", 1)))
    step(j, [p for p in pods(j) if p.name != "tj-worker-1"])
    result = step(j, pods(j, ps0=("Failed", 137)))
    failed = cond(result.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "1 pod replacement reached runPolicy.backoffLimit (1)" in failed["message"]
    assert "the next failure: ps 0 (pod tj-ps-0) failed with exit code 137" in failed["message"]
    # the ps was not replaced: status counts the one replacement that happened, by its role
    assert result.status["restarts"] == 1
    # a count of 0 is left out of the status, as Kubernetes' own statuses leave it
    assert {r: c.get("restarts") for r, c in result.status["replicaStatuses"].items()} == {
        "ps": None,
        "worker": 1,
    }


def test_the_active_deadline_is_a_real_timer() -> None:
    j = job(run={"activeDeadlineSeconds": 60})
    result = step(j, pods(j))
    assert result.requeue_after == 60
    later = step(j, pods(j), NOW + timedelta(seconds=45))
    assert later.requeue_after == pytest.approx(15)
    over = step(j, pods(j), NOW + timedelta(seconds=61))
    failed = cond(over.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "DeadlineExceeded"
    assert sorted(over.delete) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]


@pytest.mark.parametrize(
    ("chief", "clean", "at_once", "after_grace"),
    [
        (1, "Running", [], ["tj-ps-0", "tj-worker-0", "tj-worker-1"]),
        (0, "Running", [], ["tj-ps-0", "tj-worker-1"]),
        (0, "None", [], []),
        (0, "All", ["tj-ps-0", "tj-worker-0", "tj-worker-1"], []),
    ],
    ids=["chief-decides", "worker-0-decides", "clean-none", "clean-all"],
)
def test_the_chief_or_worker_0_decides_success_and_clean_pod_policy_applies_after_a_grace(
    chief: int, clean: str, at_once: list[str], after_grace: list[str]
) -> None:
    j = job(chief=chief, run={"cleanPodPolicy": clean})
    step(j, pods(j))
    decider = "chief0" if chief else "worker0"
    ended = pods(j, **{decider: ("Succeeded", 0)})
    result = step(j, ended)
    succeeded = cond(result.status, "Succeeded")
    assert succeeded is not None
    assert succeeded["reason"] == "JobSucceeded"
    assert cond(result.status, "Running")["status"] == "False"  # type: ignore[index]
    assert result.status["completionTime"] == "2026-11-21T12:00:00Z"
    # the running pods were told to stop: they end on their own, their logs kept
    assert sorted(result.delete) == at_once
    grace = cleanup.RUNNING_GRACE_SECONDS
    assert result.requeue_after == (grace if after_grace else None)
    later = step(j, ended, NOW + timedelta(seconds=grace - 1))
    assert sorted(later.delete) == at_once
    assert later.requeue_after == (pytest.approx(1.0) if after_grace else None)
    over = step(j, ended, NOW + timedelta(seconds=grace))
    assert sorted(over.delete) == sorted(at_once + after_grace)


def test_a_succeeded_jobs_pending_pods_go_at_once_and_those_that_ended_stay() -> None:
    j = job(ps=2)
    step(j, pods(j))
    ended = pods(j, worker0=("Succeeded", 0), ps0=("Succeeded", 0), ps1=("Pending", None))
    result = step(j, ended)
    assert result.status["state"] == "Succeeded"
    assert result.delete == ["tj-ps-1"]  # a pending pod will not end on its own
    assert result.requeue_after == cleanup.RUNNING_GRACE_SECONDS  # worker 1 still runs


def test_a_failed_jobs_running_pods_are_deleted_at_once() -> None:
    j = job(policy="Never")
    step(j, pods(j))
    result = step(j, pods(j, worker1=("Failed", 1)))
    assert result.status["state"] == "Failed"
    assert sorted(result.delete) == ["tj-ps-0", "tj-worker-0"]
    assert result.requeue_after is None


def test_all_workers_success_policy_waits_for_every_worker() -> None:
    j = job(success="allWorkers")
    step(j, pods(j))
    one = step(j, pods(j, worker0=("Succeeded", 0)))
    assert cond(one.status, "Succeeded") is None
    both = step(j, pods(j, worker0=("Succeeded", 0), worker1=("Succeeded", 0)))
    assert cond(both.status, "Succeeded") is not None
    assert "every worker succeeded" in cond(both.status, "Succeeded")["message"]  # type: ignore[index]


def test_ttl_after_finished_requeues_then_deletes_the_job() -> None:
    j = job(run={"ttlSecondsAfterFinished": 30})
    step(j, pods(j))
    done = step(j, pods(j, worker0=("Succeeded", 0)))
    assert done.requeue_after == 30
    assert not done.delete_job
    assert step(j, [], NOW + timedelta(seconds=31)).delete_job


def test_suspend_deletes_the_pods_and_resume_creates_them_again() -> None:
    j = job()
    step(j, pods(j))
    j["spec"]["runPolicy"]["suspend"] = True
    suspended = step(j, pods(j))
    # the ps last: they serve while the chief (worker 0) writes its checkpoint on SIGTERM
    assert sorted(suspended.delete) == ["tj-worker-0", "tj-worker-1"]
    assert cond(suspended.status, "Suspended")["reason"] == "JobSuspended"  # type: ignore[index]
    assert suspended.status["state"] == "Suspended"
    leaving = [dataclasses.replace(p, deleting=True) if p.role == "worker" else p for p in pods(j)]
    assert step(j, leaving).delete == []  # not while a worker leaves
    assert step(j, [p for p in pods(j) if p.role == "ps"]).delete == ["tj-ps-0"]
    assert step(j, []).create == []
    j["spec"]["runPolicy"]["suspend"] = False
    resumed = step(j, [], NOW + timedelta(seconds=5))
    assert len(resumed.create) == 3
    assert cond(resumed.status, "Suspended")["status"] == "False"  # type: ignore[index]
    assert cond(resumed.status, "Suspended")["reason"] == "JobResumed"  # type: ignore[index]
    assert resumed.status["startTime"] == "2026-11-21T12:00:05Z"  # the deadline restarts


def test_a_finished_job_creates_nothing_and_planning_again_changes_nothing() -> None:
    j = job()
    step(j, pods(j))
    first = step(j, pods(j, worker0=("Succeeded", 0)))
    again = planner.plan(
        j, [p for p in pods(j) if p.name == "tj-worker-0"], NOW, network=builders.dns_network(j)
    )
    assert again.create == []
    assert again.status["conditions"] == first.status["conditions"]
    assert again.status["state"] == "Succeeded"


def test_pods_run_the_operators_runtime_image_unless_their_template_names_one() -> None:
    j = job(ps=1, workers=1)
    j["spec"]["replicaSpecs"]["ps"]["template"] = {
        "spec": {"containers": [{"name": "jaxps", "image": "mine/ps:1"}]}
    }
    result = step(j, [], service_exists=True, image="localhost/jaxps/runtime:0.1.0-x")
    images = {p["metadata"]["name"]: p["spec"]["containers"][0]["image"] for p in result.create}
    assert images == {"tj-ps-0": "mine/ps:1", "tj-worker-0": "localhost/jaxps/runtime:0.1.0-x"}
    assert not builders.DEFAULT_IMAGE.endswith(":latest")  # :latest would pull on every start


def test_the_kubelet_probes_health_over_http_on_the_metrics_port_unless_the_template_does() -> None:
    j = job(ps=1, workers=1)
    own = {"exec": {"command": ["true"]}, "periodSeconds": 30}
    j["spec"]["replicaSpecs"]["ps"]["template"] = {
        "spec": {"containers": [{"name": "jaxps", "livenessProbe": own}]}
    }
    result = step(j, [], service_exists=True)
    containers = {p["metadata"]["name"]: p["spec"]["containers"][0] for p in result.create}
    worker, ps = containers["tj-worker-0"], containers["tj-ps-0"]
    assert {"name": "metrics", "containerPort": builders.METRICS_PORT} in worker["ports"]
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        assert worker[probe]["httpGet"] == {"path": path, "port": "metrics"}  # no TLS: plain GET
    # the startup probe waits longer than the liveness probe gives up
    start, live = worker["startupProbe"], worker["livenessProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 300
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    assert ps["livenessProbe"] == own
    assert ps["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_a_misspelt_training_fails_the_job_before_any_pod_naming_every_field() -> None:
    j = job()
    j["spec"]["training"] = {
        "steps": 10,
        "model": {"name": "resnet"},
        "optimizer": {"name": "sgdd"},
    }
    result = step(j, [], service_exists=False)
    assert result.create == []
    failed = cond(result.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "InvalidTraining"
    assert "spec.training.model.name" in failed["message"]
    assert '"resnet"' in failed["message"]
    assert "spec.training.optimizer.name" in failed["message"]
    assert '"sgdd"' in failed["message"]
    assert result.status["restarts"] == 0


def with_env(j: dict[str, Any], role: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    j["spec"]["replicaSpecs"][role]["template"] = {
        "spec": {"containers": [{"name": "jaxps", "env": env}]}
    }
    return j


def test_a_template_setting_a_value_the_runtime_refuses_fails_the_job_before_any_pod() -> None:
    j = with_env(
        with_env(
            job(),
            "worker",
            [
                {"name": "JAXPS_LOG_LEVEL", "value": "LOUD"},
                {"name": "JAXPS_XLA_THREADS", "value": "half"},
            ],
        ),
        "ps",
        [{"name": "OTHER", "value": "x"}, {"name": "JAXPS_PS_XLA_THREADS", "value": "0"}],
    )
    result = step(j, [], service_exists=False)
    assert result.create == []
    failed = cond(result.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "InvalidTemplate"
    assert (
        "spec.replicaSpecs.worker.template.spec.containers[0].env[0].value: JAXPS_LOG_LEVEL: "
        'got "LOUD"; expected one of DEBUG, INFO, WARNING, ERROR' in failed["message"]
    )
    assert (
        "spec.replicaSpecs.ps.template.spec.containers[0].env[1].value: JAXPS_PS_XLA_THREADS: "
        'got "0"' in failed["message"]
    )
    assert (
        "spec.replicaSpecs.worker.template.spec.containers[0].env[1].value: JAXPS_XLA_THREADS: "
        'got "half"' in failed["message"]
    )


def test_template_settings_the_runtime_takes_start_the_pods() -> None:
    j = with_env(
        with_env(job(), "worker", [{"name": "JAXPS_LOG_LEVEL", "value": "debug"}]),
        "ps",
        [
            {"name": "JAXPS_PS_XLA_THREADS", "value": "2"},
            {
                "name": "JAXPS_LOG_LEVEL",
                "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
            },
        ],
    )
    # a worker does not read JAXPS_PS_XLA_THREADS, nor a ps JAXPS_XLA_THREADS: nothing to refuse
    j["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]["env"] += [
        {"name": "JAXPS_PS_XLA_THREADS", "value": "many"},
        {"name": "JAXPS_XLA_THREADS", "value": "4"},
    ]
    j["spec"]["replicaSpecs"]["ps"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "JAXPS_XLA_THREADS", "value": "many"}
    )
    result = step(j, [], service_exists=False)
    assert cond(result.status, "Failed") is None
    assert len([o for o in result.create if o["kind"] == "Pod"]) == 3


@pytest.mark.parametrize("policy", ["OnFailure", "Always", "ExitCode"])
def test_a_task_that_refuses_its_training_fails_the_job_at_once_whatever_the_policy(
    policy: str,
) -> None:
    j = job(policy=policy)
    step(j, pods(j))
    refused = [
        p
        if p.name != "tj-worker-1"
        else PodState(
            p.name,
            p.role,
            p.index,
            "Failed",
            exit_code=78,
            message="JAXPS_TRAINING.optimizer.kwargs: optax.sgd refused them",
        )
        for p in pods(j)
    ]
    result = step(j, refused)
    failed = cond(result.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "InvalidTraining"
    assert "worker 1 (pod tj-worker-1)" in failed["message"]
    assert "optax.sgd refused them" in failed["message"]
    assert result.status["restarts"] == 0
    assert result.replaced == []
    assert "tj-worker-1" not in result.delete  # it is not replaced; the others are cleaned up


def test_a_templates_own_jaxps_variables_are_kept_and_reserved_ones_replaced() -> None:
    j = job(ps=1, workers=1)
    j["spec"]["replicaSpecs"]["worker"]["template"] = {
        "spec": {
            "containers": [
                {
                    "name": "jaxps",
                    "env": [
                        {"name": "JAXPS_LOG_LEVEL", "value": "DEBUG"},
                        {"name": "JAXPS_BIND_ADDRESS", "value": "0.0.0.0:2222"},
                        {"name": "TF_CONFIG", "value": "{}"},
                        {"name": "MINE", "value": "1"},
                    ],
                }
            ]
        }
    }
    created = {c["metadata"]["name"]: c for c in step(j, []).create}
    env = created["tj-worker-0"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert names.count("TF_CONFIG") == 1
    values = {e["name"]: e.get("value") for e in env}
    assert values["JAXPS_LOG_LEVEL"] == "DEBUG"
    assert values["JAXPS_BIND_ADDRESS"] == "0.0.0.0:2222"
    assert values["MINE"] == "1"
    assert cluster.parse_tf_config(values["TF_CONFIG"]).task == cluster.TaskSpec("worker", 0)


def test_pods_name_the_addresses_and_metrics_ports_the_network_gives() -> None:
    j = job(ps=1, workers=2)
    network = builders.Network(
        addresses={"ps": ["127.0.0.1:4001"], "worker": ["127.0.0.1:4002", "127.0.0.1:4003"]},
        metrics_ports={"tj-worker-1": 5003},
    )
    created = {c["metadata"]["name"]: c for c in step(j, [], network=network).create}
    main = created["tj-worker-1"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    tf = cluster.parse_tf_config(env["TF_CONFIG"])
    assert tf.cluster.addresses("worker") == ("127.0.0.1:4002", "127.0.0.1:4003")
    assert env["JAXPS_METRICS_PORT"] == "5003"
    assert {"name": "grpc", "containerPort": 4003} in main["ports"]
    assert {"name": "metrics", "containerPort": 5003} in main["ports"]


def replaced_by(
    j: dict[str, Any], name: str, changed: PodState, phase: str = "Running"
) -> list[PodState]:
    """Every pod of the job in `phase`, the one called `name` being `changed`."""
    return [changed if p.name == name else p for p in pods(j, phase)]


FINAL = [
    (78, "InvalidTraining", "refused its training configuration"),
    (79, "UserCodeError", "failed in the user's code"),
    (80, "Diverged", "found the training diverged"),
    (81, "Stalled", "found the training stalled"),
]


@pytest.mark.parametrize("policy", ["OnFailure", "Always", "ExitCode", "Never"])
@pytest.mark.parametrize(("code", "reason", "what"), FINAL, ids=[r for _, r, _ in FINAL])
def test_a_final_exit_code_ends_the_job_at_once_with_its_reason_and_cause(
    code: int, reason: str, what: str, policy: str
) -> None:
    j = job(policy=policy)
    step(j, pods(j))
    cause = "ValueError: bad batch (train.py:12)"
    ended = PodState("tj-worker-1", "worker", 1, "Failed", exit_code=code, message=cause)
    result = step(j, replaced_by(j, "tj-worker-1", ended))
    failed = cond(result.status, "Failed")
    assert failed is not None
    assert failed["reason"] == reason
    assert failed["message"] == f"worker 1 (pod tj-worker-1) {what} (exit code {code}): {cause}"
    assert [(e.type, e.reason, e.message) for e in result.events][-1] == (
        "Warning",
        reason,
        failed["message"],
    )
    assert result.status["restarts"] == 0
    assert result.replaced == []


LIMIT_FIELD = "spec.replicaSpecs.ps.template.spec.containers[0].resources.limits.memory"


def oom(
    j: dict[str, Any], *, limit: str | None = "1Gi", reason: str = "OOMKilled"
) -> list[PodState]:
    killed = PodState(
        "tj-ps-0",
        "ps",
        0,
        "Failed",
        exit_code=137,
        reason=reason,
        container_reason=reason,
        memory_limit=limit,
    )
    return replaced_by(j, "tj-ps-0", killed)


def test_an_oom_killed_pod_is_replaced_and_the_event_says_oom_killed_and_the_limit() -> None:
    j = job(policy="ExitCode")
    step(j, pods(j))
    result = step(j, oom(j))
    assert result.replaced == [("ps", 0)]
    replaced = next(e for e in result.events if e.reason == "PodReplaced")
    assert replaced.message == (
        "ps 0 (pod tj-ps-0) was OOMKilled (exit code 137, memory limit 1Gi); "
        "replacing it (restartPolicy ExitCode)"
    )


@pytest.mark.parametrize(
    ("limit", "said"), [("1Gi", "with its memory limit 1Gi"), (None, "with no memory limit")]
)
def test_an_oom_killed_pod_that_ends_the_job_names_its_limit_and_what_to_change(
    limit: str | None, said: str
) -> None:
    j = job(policy="Never")
    step(j, pods(j))
    result = step(j, oom(j, limit=limit))
    failed = cond(result.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "OOMKilled"
    assert f"ps 0 (pod tj-ps-0) was OOMKilled (exit code 137) {said}" in failed["message"]
    assert LIMIT_FIELD in failed["message"]
    assert "restartPolicy is Never" in failed["message"]


def test_an_oom_kill_past_the_backoff_limit_fails_the_job_as_oom_killed() -> None:
    j = job(run={"backoffLimit": 0})
    step(j, pods(j))
    failed = cond(step(j, oom(j)).status, "Failed")
    assert failed is not None
    assert failed["reason"] == "OOMKilled"
    assert LIMIT_FIELD in failed["message"]
    assert "0 pod replacements reached runPolicy.backoffLimit (0)" in failed["message"]


def test_exit_137_without_oom_killed_stays_a_plain_kill() -> None:
    j = job(policy="Never")
    step(j, pods(j))
    failed = cond(step(j, oom(j, reason="Error")).status, "Failed")
    assert failed is not None
    assert failed["reason"] == "ReplicaFailed"
    assert "ps 0 (pod tj-ps-0) failed with exit code 137" in failed["message"]
    assert "OOMKilled" not in failed["message"]


UNSCHEDULABLE = "0/1 nodes are available: 1 Insufficient cpu."


def waiting(
    j: dict[str, Any],
    *,
    reason: str = "Unschedulable",
    message: str = UNSCHEDULABLE,
    since: datetime = NOW,
) -> list[PodState]:
    stuck = PodState(
        "tj-worker-1",
        "worker",
        1,
        "Pending",
        waiting_reason=reason,
        waiting_message=message,
        created=since,
    )
    return replaced_by(j, "tj-worker-1", stuck)


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("Unschedulable", UNSCHEDULABLE),
        ("Unschedulable", '0/1 nodes are available: persistentvolumeclaim "x" not found.'),
        ("ErrImagePull", 'failed to pull image "mine/jaxps:typo": not found'),
        ("CreateContainerConfigError", 'secret "creds" not found'),
    ],
    ids=["insufficient-cpu", "missing-claim", "image", "config"],
)
def test_a_waiting_pod_says_why_in_pods_ready_and_one_warning_per_change(
    reason: str, message: str
) -> None:
    j = job()
    step(j, [])
    young = step(j, waiting(j, reason=reason, message=message))
    # a pod that has just been created may wait a moment (a claim binding): not said yet
    assert [e for e in young.events if e.type == "Warning"] == []
    assert young.requeue_after == pytest.approx(schedule.QUIET_SECONDS)
    result = step(j, waiting(j, reason=reason, message=message), NOW + timedelta(seconds=10))
    ready = cond(result.status, "PodsReady")
    assert ready is not None
    assert (ready["status"], ready["reason"]) == ("False", reason)
    assert ready["message"] == f"pod tj-worker-1 (worker 1) waits: {reason}: {message}"
    assert [(e.reason, e.message) for e in result.events if e.type == "Warning"] == [
        (reason, ready["message"])
    ]
    assert result.requeue_after is None  # no scheduleTimeoutSeconds: it waits
    again = step(j, waiting(j, reason=reason, message=message), NOW + timedelta(seconds=30))
    assert again.events == []  # said once, not every pass
    assert cond(again.status, "Failed") is None
    # it runs now: PodsReady says so
    back = step(j, pods(j), NOW + timedelta(seconds=60))
    assert cond(back.status, "PodsReady")["status"] == "True"  # type: ignore[index]


def test_pods_that_start_one_by_one_post_no_warning_each() -> None:
    """Which pod waits longest and how many more wait are in PodsReady's message, not a new
    Event each time they change (a job starting its pods one by one posted one per pod)."""
    j = job(workers=4)
    step(j, [])

    def stuck(names: set[str]) -> list[PodState]:
        return [
            PodState(
                p.name,
                p.role,
                p.index,
                "Pending",
                waiting_reason="Unschedulable",
                waiting_message=UNSCHEDULABLE,
                created=NOW,
            )
            if p.name in names
            else p
            for p in pods(j)
        ]

    names = {f"tj-worker-{i}" for i in (1, 2, 3)}
    first = step(j, stuck(names), NOW + timedelta(seconds=10))
    ready = cond(first.status, "PodsReady")
    assert ready is not None
    assert ready["message"].endswith("(and 2 more pods wait)")
    assert [e.reason for e in first.events if e.type == "Warning"] == ["Unschedulable"]
    fewer = step(j, stuck(names - {"tj-worker-3"}), NOW + timedelta(seconds=11))
    ready = cond(fewer.status, "PodsReady")
    assert ready is not None
    assert ready["message"].endswith("(and 1 more pods wait)")
    assert [e for e in fewer.events if e.type == "Warning"] == []
    other = step(j, stuck({"tj-worker-2"}), NOW + timedelta(seconds=12))  # worker 1 started
    ready = cond(other.status, "PodsReady")
    assert ready is not None
    assert ready["message"] == f"pod tj-worker-2 (worker 2) waits: Unschedulable: {UNSCHEDULABLE}"
    assert [e for e in other.events if e.type == "Warning"] == []  # the same reason and words
    pull = "Back-off pulling image"
    image = [
        PodState(
            p.name,
            p.role,
            p.index,
            "Pending",
            waiting_reason="ImagePullBackOff",
            waiting_message=pull,
            created=NOW,
        )
        if p.name == "tj-worker-2"
        else p
        for p in pods(j)
    ]
    changed = step(j, image, NOW + timedelta(seconds=13))  # another reason: said
    assert [e.message for e in changed.events if e.type == "Warning"] == [
        f"pod tj-worker-2 (worker 2) waits: ImagePullBackOff: {pull}"
    ]


def test_a_pod_that_waits_past_the_schedule_timeout_fails_the_job_by_a_timer() -> None:
    j = job(run={"scheduleTimeoutSeconds": 300})
    j["spec"]["replicaSpecs"]["worker"]["minReplicas"] = 2  # worker 1 is needed
    step(j, [])
    first = step(j, waiting(j), NOW + timedelta(seconds=100))
    assert first.requeue_after == pytest.approx(200)
    over = step(j, waiting(j), NOW + timedelta(seconds=300))
    failed = cond(over.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "Unschedulable"
    assert failed["message"] == (
        "pod tj-worker-1 (worker 1) waited 300 s, past runPolicy.scheduleTimeoutSeconds "
        f"(300 s): Unschedulable: {UNSCHEDULABLE}"
    )
    assert "tj-worker-1" in over.delete


def test_a_chief_that_succeeded_wins_over_a_ps_killed_in_the_same_pass() -> None:
    j = job(chief=1)
    step(j, pods(j))
    result = step(j, pods(j, chief0=("Succeeded", 0), ps0=("Failed", 137)))
    assert result.status["state"] == "Succeeded"
    assert cond(result.status, "Failed") is None
    assert result.replaced == []
    assert result.status["restarts"] == 0
    assert "PodReplaced" not in [e.reason for e in result.events]


def test_a_chief_killed_after_recording_its_summary_succeeded() -> None:
    j = job(policy="Never")
    step(j, pods(j))
    done = json.dumps({"event": "done", "step": 10, "loss": 0.1}) + "\n"
    killed = PodState("tj-worker-0", "worker", 0, "Failed", exit_code=137, message=done)
    result = step(j, replaced_by(j, "tj-worker-0", killed))
    succeeded = cond(result.status, "Succeeded")
    assert succeeded is not None
    assert "worker 0 (its final summary was recorded" in succeeded["message"]
    assert cond(result.status, "Failed") is None
    assert result.status["progress"]["step"] == 10


def test_a_failed_final_checkpoint_is_said_in_the_progress_the_condition_and_an_event() -> None:
    """The chief's log alone said `[Errno 28] No space left on device`; the job read
    Succeeded, and the steps since the last checkpoint were nowhere once the ps shut down."""
    j = job()
    step(j, pods(j))
    error = "ps-0: [Errno 28] No space left on device"
    done = json.dumps({"event": "done", "step": 50, "checkpointError": error})
    ended = PodState("tj-worker-0", "worker", 0, "Succeeded", exit_code=0, message=done)
    result = step(j, replaced_by(j, "tj-worker-0", ended))
    assert result.status["progress"]["checkpointError"] == error
    succeeded = cond(result.status, "Succeeded")
    assert succeeded is not None
    assert succeeded["message"] == f"worker 0 succeeded; but its final checkpoint failed: {error}"
    assert ("Warning", "CheckpointFailed") in [(e.type, e.reason) for e in result.events]


@pytest.mark.parametrize("chief", [0, 1], ids=["worker-0", "chief"])
def test_a_chief_that_exited_0_without_its_summary_fails_the_job_no_outcome(chief: int) -> None:
    j = job(chief=chief)
    step(j, pods(j))
    role = "chief" if chief else "worker"
    name = f"tj-{role}-0"
    early = PodState(name, role, 0, "Succeeded", exit_code=0, message="")
    result = step(j, replaced_by(j, name, early))
    assert cond(result.status, "Succeeded") is None
    failed = cond(result.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "NoOutcome"
    assert (
        f"{role} 0 (pod {name}) exited 0 without recording the job's outcome" in (failed["message"])
    )
    assert result.replaced == []


def test_a_chief_killed_before_its_summary_is_replaced() -> None:
    j = job()
    step(j, pods(j))
    result = step(j, pods(j, worker0=("Failed", 137)))
    assert result.replaced == [("worker", 0)]
    assert cond(result.status, "Succeeded") is None


TRAINING = {"jaxps_global_step": 5.0, "jaxps_training": 1.0}


def test_a_step_that_does_not_move_while_the_chief_trains_fails_the_job_stalled() -> None:
    j = job()
    j["spec"]["training"]["progressTimeoutSeconds"] = 100
    step(j, pods(j), metrics=TRAINING)
    assert j["status"]["progress"]["stepTime"] == "2026-11-21T12:00:00Z"
    waiting_ = step(j, pods(j), NOW + timedelta(seconds=150), metrics=TRAINING)
    assert waiting_.requeue_after == pytest.approx(10)  # 100 s + the chief's 60 s first
    assert cond(waiting_.status, "Failed") is None
    over = step(j, pods(j), NOW + timedelta(seconds=160), metrics=TRAINING)
    failed = cond(over.status, "Failed")
    assert failed is not None
    assert failed["reason"] == "Stalled"
    assert "has not moved from 5 for 160 s" in failed["message"]


def test_a_step_that_moves_or_a_chief_not_training_is_no_stall() -> None:
    j = job()
    j["spec"]["training"]["progressTimeoutSeconds"] = 100
    step(j, pods(j), metrics=TRAINING)
    moved = {**TRAINING, "jaxps_global_step": 6.0}
    result = step(j, pods(j), NOW + timedelta(seconds=150), metrics=moved)
    assert result.status["progress"]["stepTime"] == "2026-11-21T12:02:30Z"
    # a long synchronous checkpoint: the clock is held while the chief does not train
    checkpointing = {**moved, "jaxps_training": 0.0}
    step(j, pods(j), NOW + timedelta(seconds=1000), metrics=checkpointing)
    back = step(j, pods(j), NOW + timedelta(seconds=1010), metrics=moved)
    assert cond(back.status, "Failed") is None
    assert back.requeue_after == pytest.approx(150)


def test_a_progress_timeout_of_0_turns_the_backstop_off() -> None:
    j = job()
    j["spec"]["training"]["progressTimeoutSeconds"] = 0
    step(j, pods(j), metrics=TRAINING)
    result = step(j, pods(j), NOW + timedelta(days=1), metrics=TRAINING)
    assert cond(result.status, "Failed") is None
    assert result.requeue_after is None
