"""The reconcile pass against an in-memory `Cluster`: every policy path, as a backend sees it.

`Memory` holds one stored job (with a resourceVersion, as the API server keeps it), its pods and
its Service; the tests move pods as a kubelet would (phase, exit code, termination message) and
check what the pass wrote, created, deleted and posted.
"""

from __future__ import annotations

import base64
import copy
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jaxps_operator import builders, capacity, issuer, kube, reconcile, schema
from jaxps_operator.conditions import Event
from jaxps_operator.objects import PodState
from jaxps_operator.policy import cleanup
from jaxps_operator.reconcile import Children, ConflictError
from jaxps_runtime.wire import credentials

NOW = datetime(2026, 11, 23, 9, 0, 0, tzinfo=UTC)
DONE = {"event": "done", "step": 50, "loss": 0.1, "eval": {"accuracy": 0.9}, "stepsPerSecond": 5.0}


@dataclass
class Memory:
    """A `Cluster` in memory."""

    job: dict[str, Any] | None
    pods: dict[str, PodState] = field(default_factory=dict)
    service: bool = False
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict)
    policies: list[str] = field(default_factory=list)
    issued: int = 0
    events: list[Event] = field(default_factory=list)
    status_writes: int = 0
    created: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # pod name -> metrics

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.job)

    def children(self, job: Mapping[str, Any]) -> Children:
        return Children(
            pods=list(self.pods.values()),
            service=self.service,
            secret=bool(self.secrets),
            network_policy=bool(self.policies),
            issued_workers=capacity.issued_workers(
                [k for s in self.secrets.values() for k in s["data"]], job
            )
            if self.secrets
            else None,
            secret_changed=next(
                (why for s in self.secrets.values() if (why := kube.secret_changed(s))), ""
            ),
        )

    def credentials(self, job: Mapping[str, Any], network: builders.Network) -> dict[str, bytes]:
        self.issued += 1
        return issuer.issue(job, network)

    def network(self, job: Mapping[str, Any]) -> builders.Network:
        return builders.dns_network(job)

    def create(self, job: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
        name = manifest["metadata"]["name"]
        self.created.append(name)
        if manifest["kind"] == "Service":
            existed, self.service = self.service, True
            return not existed
        if manifest["kind"] == "Secret":
            self.secrets[name] = dict(manifest)
            return True
        if manifest["kind"] == "NetworkPolicy":
            self.policies.append(name)
            return True
        if name in self.pods:
            return False
        labels = manifest["metadata"]["labels"]
        self.pods[name] = PodState(
            name, labels[builders.LABEL_ROLE], int(labels[builders.LABEL_INDEX]), "Pending"
        )
        return True

    def delete_pod(self, job: Mapping[str, Any], name: str, *, force: bool = False) -> bool:
        self.deleted.append(name)
        return self.pods.pop(name, None) is not None

    def write_status(self, job: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        assert self.job is not None
        if job["metadata"]["resourceVersion"] != self.job["metadata"]["resourceVersion"]:
            raise ConflictError("changed")
        self.status_writes += 1
        self.job["status"] = copy.deepcopy(dict(status))
        self.job["metadata"]["resourceVersion"] += 1

    def post_event(self, job: Mapping[str, Any], event: Event) -> None:
        self.events.append(event)

    def delete_job(self, job: Mapping[str, Any]) -> None:
        self.job = None
        self.pods.clear()

    def task_progress(self, pod: PodState) -> dict[str, float]:
        return self.metrics.get(pod.name, {})

    # --- a kubelet's moves ------------------------------------------------------------------

    def run_all(self) -> None:
        for name, p in self.pods.items():
            self.pods[name] = replace(p, phase="Running", ready=True, metrics=f"{name}:9090")

    def end(self, name: str, code: int, message: str = "") -> None:
        phase = "Succeeded" if code == 0 else "Failed"
        self.pods[name] = replace(
            self.pods[name], phase=phase, ready=False, exit_code=code, message=message
        )

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]


def manifest(
    *,
    training: dict[str, Any] | None = None,
    run: dict[str, Any] | None = None,
    policy: str = "OnFailure",
) -> dict[str, Any]:
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": "tj",
            "namespace": "ns",
            "uid": "u-1",
            "generation": 1,
            "resourceVersion": 1,
        },
        "spec": {
            "replicaSpecs": {
                "ps": {"replicas": 1, "restartPolicy": policy},
                "worker": {"replicas": 2, "restartPolicy": policy},
            },
            "training": training or {"steps": 50},
            "runPolicy": run or {},
        },
    }


def cond(memory: Memory, type_: str) -> dict[str, Any]:
    assert memory.job is not None
    conditions: list[dict[str, Any]] = memory.job["status"].get("conditions", [])
    found = [c for c in conditions if c["type"] == type_]
    assert found, f"no {type_} condition in {memory.job['status']}"
    return found[0]


class Pass:
    """Runs passes over one Memory with one Validator, `now` moving as the test says."""

    def __init__(self, memory: Memory) -> None:
        self.memory, self.validator = memory, reconcile.Validator()

    def __call__(self, now: datetime = NOW, **kw: Any) -> reconcile.Outcome:
        return reconcile.reconcile(self.memory, "ns", "tj", now=now, validator=self.validator, **kw)


def started(**kw: Any) -> tuple[Memory, Pass]:
    memory = Memory(manifest(**kw))
    run = Pass(memory)
    run()
    memory.run_all()
    run()
    return memory, run


def test_a_new_job_gets_its_service_pods_and_one_status_write_per_change() -> None:
    memory = Memory(manifest())
    run = Pass(memory)
    outcome = run()
    assert memory.created == ["tj", "tj-tls-u-1", "tj-ps-0", "tj-worker-0", "tj-worker-1"]
    assert memory.status_writes == 1
    assert outcome.state == "Created"
    assert memory.reasons() == ["JobCreated", "Created"]
    run()  # the pods are Pending now: replicaStatuses change
    assert memory.status_writes == 2
    run()
    assert memory.status_writes == 2  # nothing changed: nothing written
    assert memory.created == ["tj", "tj-tls-u-1", "tj-ps-0", "tj-worker-0", "tj-worker-1"]
    assert memory.issued == 1  # credentials are issued once per job


def test_a_running_chief_fills_the_progress_and_asks_for_the_next_read() -> None:
    memory, run = started()
    memory.metrics["tj-worker-0"] = {"jaxps_global_step": 12.0, "jaxps_loss": 0.7}
    outcome = run(progress_interval=2.0)
    assert memory.job is not None
    assert memory.job["status"]["progress"]["step"] == 12
    assert memory.job["status"]["state"] == "Running"
    assert outcome.requeue_after == 2.0


def test_success_makes_the_progress_final_from_the_termination_message_and_cleans_up() -> None:
    memory, run = started()
    memory.end("tj-worker-0", 0, json.dumps(DONE) + "\n")
    outcome = run(progress_interval=2.0)
    assert outcome.state == "Succeeded"
    assert outcome.requeue_after == cleanup.RUNNING_GRACE_SECONDS  # no progress read: the grace
    assert memory.job is not None
    assert memory.job["status"]["progress"]["step"] == 50
    assert memory.job["status"]["progress"]["eval"] == {"accuracy": 0.9}
    assert memory.deleted == []  # told to stop, they end on their own: their logs stay
    assert "JobSucceeded" in memory.reasons()
    memory.end("tj-worker-1", 0)
    run(NOW + timedelta(seconds=5))
    assert memory.deleted == []
    outcome = run(NOW + timedelta(seconds=cleanup.RUNNING_GRACE_SECONDS))
    assert memory.deleted == ["tj-ps-0"]  # no ps outlives its job
    assert outcome.requeue_after is None


def test_a_failed_pod_is_replaced_counted_and_reported_by_role() -> None:
    memory, run = started()
    memory.end("tj-ps-0", 137)
    outcome = run()
    assert outcome.replaced == [("ps", 0)]
    assert outcome.state == "Restarting"
    assert memory.deleted == ["tj-ps-0"]
    assert memory.job is not None
    assert memory.job["status"]["restarts"] == 1
    assert "PodReplaced" in memory.reasons()
    run()
    assert "tj-ps-0" in memory.pods  # created again once gone
    memory.run_all()
    assert run().state == "Running"


def test_a_task_refusing_its_training_fails_the_job_at_once_with_its_message() -> None:
    memory, run = started()
    memory.end("tj-worker-1", 78, "JAXPS_TRAINING.model.module: cannot import 'mine'")
    outcome = run()
    assert outcome.state == "Failed"
    assert outcome.replaced == []
    failed = cond(memory, "Failed")
    assert failed["reason"] == "InvalidTraining"
    assert "cannot import 'mine'" in failed["message"]


def test_a_misspelt_training_creates_no_pod_and_fails_once() -> None:
    memory = Memory(manifest(training={"model": {"name": "resnet"}, "optimizer": {"name": "sgdd"}}))
    run = Pass(memory)
    assert run().state == "Failed"
    assert memory.pods == {}
    failed = cond(memory, "Failed")
    assert failed["reason"] == "InvalidTraining"
    assert "spec.training.model.name" in failed["message"]
    assert "spec.training.optimizer.name" in failed["message"]
    run()
    assert memory.reasons().count("InvalidTraining") == 1


def test_never_fails_the_job_with_the_task_and_exit_code() -> None:
    memory, run = started(policy="Never")
    memory.end("tj-worker-1", 1)
    assert run().state == "Failed"
    assert cond(memory, "Failed")["reason"] == "ReplicaFailed"
    assert "worker 1 (pod tj-worker-1) failed with exit code 1" in cond(memory, "Failed")["message"]


def test_the_backoff_limit_ends_the_job() -> None:
    memory, run = started(run={"backoffLimit": 0})
    memory.end("tj-ps-0", 137)
    assert run().state == "Failed"
    assert cond(memory, "Failed")["reason"] == "BackoffLimitExceeded"


def test_the_deadline_is_a_timer_then_fails_the_job() -> None:
    memory, run = started(run={"activeDeadlineSeconds": 30})
    assert run(NOW + timedelta(seconds=10)).requeue_after == pytest.approx(20)
    outcome = run(NOW + timedelta(seconds=31))
    assert outcome.state == "Failed"
    assert cond(memory, "Failed")["reason"] == "DeadlineExceeded"
    assert memory.pods == {}


def test_the_ttl_deletes_the_finished_job() -> None:
    memory, run = started(run={"ttlSecondsAfterFinished": 5})
    memory.end("tj-worker-0", 0)
    assert run().requeue_after == 5
    assert run(NOW + timedelta(seconds=6)).state is None
    assert memory.job is None
    assert run(NOW + timedelta(seconds=7)).state is None


def test_suspend_deletes_every_pod_and_resume_creates_them() -> None:
    memory, run = started()
    assert memory.job is not None
    memory.job["spec"]["runPolicy"]["suspend"] = True
    memory.job["metadata"]["generation"] = 2
    assert run().state == "Suspended"
    assert sorted(memory.pods) == ["tj-ps-0"]  # the ps last: the chief checkpoints first
    assert run().state == "Suspended"
    assert memory.pods == {}
    memory.job["spec"]["runPolicy"]["suspend"] = False
    memory.job["metadata"]["generation"] = 3
    run()
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]
    assert cond(memory, "Suspended")["reason"] == "JobResumed"


def test_a_spec_the_schema_refuses_is_reported_once_and_touches_nothing() -> None:
    raw = manifest()
    raw["spec"]["replicaSpecs"]["worker"]["replicas"] = 0
    memory = Memory(raw)
    run = Pass(memory)
    run()
    run()
    assert memory.reasons() == ["InvalidSpec"]
    assert memory.created == []
    assert memory.status_writes == 0


def test_a_job_changed_during_the_pass_is_a_conflict() -> None:
    memory = Memory(manifest())

    class Racing(Memory):
        def children(self, job: Mapping[str, Any]) -> Children:
            assert self.job is not None
            self.job["metadata"]["resourceVersion"] += 1  # someone else wrote meanwhile
            return super().children(job)

    racing = Racing(memory.job)
    with pytest.raises(ConflictError):
        reconcile.reconcile(racing, "ns", "tj", now=NOW, validator=reconcile.Validator())


def test_the_validator_is_safe_from_many_threads_over_changing_generations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0

    def counted(raw: Any, *, rules: bool = True) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return dict(raw)

    monkeypatch.setattr(schema, "validate", counted)
    validator = reconcile.Validator()
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for i in range(400):
                raw = manifest()
                raw["metadata"]["generation"] = (i + offset) % 3
                assert validator.job(raw)["metadata"]["generation"] == (i + offset) % 3
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    validator.forget("ns", "tj")
    assert validator.cache == {}


def test_the_operator_counts_replacements_by_the_role_of_the_replaced_pod() -> None:
    from jaxps_operator import controller

    memory = Memory(manifest())
    metrics = controller.Metrics()
    reconciler = controller.Reconciler(cluster=memory, metrics=metrics)
    reconciler.reconcile("ns", "tj")
    memory.run_all()
    memory.end("tj-ps-0", 137)
    memory.end("tj-worker-1", 143)
    reconciler.reconcile("ns", "tj")
    count = metrics.registry.get_sample_value
    assert count("jaxps_operator_pod_replacements_total", {"role": "ps"}) == 1
    assert count("jaxps_operator_pod_replacements_total", {"role": "worker"}) == 1


def test_a_job_gets_one_secret_of_credentials_and_each_pod_mounts_only_its_own() -> None:
    memory = Memory(manifest())
    Pass(memory)(network_policy=True)
    secret = memory.secrets["tj-tls-u-1"]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert set(files) == {"ca.crt"} | {
        f"tj-{t}.{e}" for t in ("ps-0", "worker-0", "worker-1") for e in ("crt", "key")
    }
    for name in ("tj-ps-0", "tj-worker-1"):
        identity = credentials.identity_of(files[f"{name}.crt"])
        assert identity is not None
        assert (identity.job, f"tj-{identity.role}-{identity.index}") == ("u-1", name)
    assert memory.policies == ["tj"]
    assert "BEGIN" not in " ".join(e.message for e in memory.events)  # no key in an Event


def test_pods_mount_their_own_certificate_and_key_and_the_ca_only() -> None:
    j = schema.validate(manifest())
    pod = builders.pod(j, "worker", 1, network=builders.dns_network(j))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == builders.TLS_VOLUME)
    assert volume["secret"]["secretName"] == "tj-tls-u-1"
    assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {
        "ca.crt": "ca.crt",
        "tj-worker-1.crt": "tls.crt",
        "tj-worker-1.key": "tls.key",
    }
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["JAXPS_TLS_DIR"] == builders.TLS_DIR
    assert pod["spec"]["securityContext"]["fsGroup"] == builders.RUNTIME_GID


@pytest.mark.parametrize("path", [None, "/var/log/last-words"])
def test_a_task_writes_its_last_words_where_its_container_has_them_read(path: str | None) -> None:
    """The chief's outcome is its termination message: a template that moves the file moves
    where the runtime writes it, or the job would end with no outcome."""
    m = manifest()
    if path is not None:
        m["spec"]["replicaSpecs"]["worker"]["template"] = {
            "spec": {"containers": [{"name": "jaxps", "terminationMessagePath": path}]}
        }
    j = schema.validate(m)
    pod = builders.pod(j, "worker", 0, network=builders.dns_network(j))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["JAXPS_TERMINATION_LOG"] == (path or "/dev/termination-log")


def test_a_network_policy_admits_the_jobs_own_pods_and_the_operator_to_metrics() -> None:
    policy = builders.network_policy(schema.validate(manifest()))
    own = {"matchLabels": {builders.LABEL_JOB: "tj"}}
    assert policy["spec"]["podSelector"] == own
    assert policy["spec"]["ingress"][0] == {"from": [{"podSelector": own}]}
    assert policy["spec"]["ingress"][1]["ports"] == [{"protocol": "TCP", "port": "metrics"}]


def test_a_pass_cut_short_by_a_conflict_after_a_kill_still_counts_the_replacement_once() -> None:
    memory, run = started()
    memory.end("tj-ps-0", 137)
    assert memory.job is not None
    memory.job["metadata"]["resourceVersion"] += 1  # someone wrote the job since it was read

    class Stale(Memory):
        def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
            stale = super().get_job(namespace, name)
            assert stale is not None
            stale["metadata"]["resourceVersion"] -= 1
            return stale

    stale = Stale(memory.job, pods=memory.pods, service=True, secrets=memory.secrets)
    with pytest.raises(ConflictError):
        reconcile.reconcile(stale, "ns", "tj", now=NOW, validator=reconcile.Validator())
    assert "tj-ps-0" in memory.pods  # nothing was touched: the pass is repeated whole
    run()  # repeated
    run()  # the pod is gone: created again
    memory.run_all()
    run()
    assert memory.job["status"]["restarts"] == 1
    assert memory.job["status"]["replicaStatuses"]["ps"]["restarts"] == 1


def test_the_chiefs_metrics_reach_the_planner_and_a_stalled_step_fails_the_job() -> None:
    memory, run = started(training={"steps": 50, "progressTimeoutSeconds": 60})
    memory.metrics["tj-worker-0"] = {"jaxps_global_step": 7.0, "jaxps_training": 1.0}
    assert run(progress_interval=10.0).requeue_after == 10.0
    assert memory.job is not None
    assert memory.job["status"]["progress"]["stepTime"] == "2026-11-23T09:00:00Z"
    outcome = run(NOW + timedelta(seconds=120), progress_interval=10.0)
    assert outcome.state == "Failed"
    failed = cond(memory, "Failed")
    assert failed["reason"] == "Stalled"
    assert "has not moved from 7 for 120 s" in failed["message"]
    json.dumps(memory.job["status"], allow_nan=False)


def test_the_operator_leaves_the_cel_rules_to_the_apiserver_and_jaxps_local_runs_them() -> None:
    """A job breaking a CEL rule cannot reach the operator (the apiserver refused it), so the
    operator does not evaluate them again; `jaxps local` has no apiserver and does. Types and
    bounds are checked by both."""
    from jaxps_operator import controller

    operator = controller.Reconciler(cluster=Memory(manifest()), metrics=controller.Metrics())
    two_chiefs = manifest()
    two_chiefs["spec"]["replicaSpecs"]["chief"] = {"replicas": 2}  # rule: at most one chief
    assert operator.validator.job(two_chiefs)["spec"]["replicaSpecs"]["chief"]["replicas"] == 2
    with pytest.raises(schema.InvalidManifestError, match="chief"):
        reconcile.Validator().job(two_chiefs)
    mistyped = manifest()
    mistyped["spec"]["replicaSpecs"]["worker"]["replicas"] = "two"
    mistyped["metadata"]["generation"] = 2  # a new spec: validated again
    for validator in (operator.validator, reconcile.Validator()):
        with pytest.raises(schema.InvalidManifestError, match="must be of type integer"):
            validator.job(mistyped)


def test_a_secret_changed_while_the_job_runs_fails_it_secret_changed_naming_it() -> None:
    memory, run = started()
    secret = memory.secrets["tj-tls-u-1"]
    secret["data"] = {**secret["data"], "tj-worker-1.key": base64.b64encode(b"other").decode()}
    before = list(memory.created)
    outcome = run()
    assert outcome.state == "Failed"
    failed = cond(memory, "Failed")
    assert failed["reason"] == "SecretChanged"
    assert (
        "the job's Secret tj-tls-u-1 (its tasks' TLS credentials) was changed"
        in (failed["message"])
    )
    assert memory.created == before  # no pod started with the changed keys
