"""Elastic workers, on the operator's side: the bounds of a scale (`capacity`), what a pass
does when the worker count changes (`policy.scale`, the planner, the reconcile pass over an
in-memory cluster), the CRD's rules offline, Kueue's pod set, `status.progress.data`, and the
local backend's `--scale` and scale requests."""

from __future__ import annotations

import base64
import copy
import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from jaxps_operator import builders, capacity, kueue, local, progress, schema
from jaxps_operator.objects import PodState
from jaxps_runtime.config import cluster
from jaxps_runtime.wire import credentials
from tests.unit.test_planner import NOW, cond, job, pods, step
from tests.unit.test_reconcile import Memory, Pass, manifest


def elastic(workers: int = 2, **spec: Any) -> dict[str, Any]:
    j = job(workers=workers)
    j["spec"]["replicaSpecs"]["worker"].update(spec)
    return schema.validate({k: v for k, v in j.items() if k != "status"}) | {"status": {}}


def scaled(j: dict[str, Any], workers: int) -> dict[str, Any]:
    out = copy.deepcopy(j)
    out["spec"]["replicaSpecs"]["worker"]["replicas"] = workers
    out["metadata"]["generation"] += 1
    return out


def workers_of(plan_create: list[dict[str, Any]]) -> list[str]:
    return [m["metadata"]["name"] for m in plan_create if m["kind"] == "Pod"]


# --- the bounds -------------------------------------------------------------------------------


def test_a_job_is_issued_max_replicas_workers_else_its_replicas() -> None:
    assert capacity.issued(elastic(2, maxReplicas=6)) == 6
    assert capacity.issued(elastic(3)) == 3
    assert capacity.capacity(elastic(2, maxReplicas=6), issued_workers=None) == 6
    # raised after creation: what was issued then still bounds it
    assert capacity.capacity(elastic(2, maxReplicas=8), issued_workers=6) == 6
    assert capacity.capacity(elastic(2), issued_workers=4) == 4


@pytest.mark.parametrize(
    ("spec", "workers", "issued", "words"),
    [
        ({"minReplicas": 2, "maxReplicas": 4}, 1, None, "replicas 1 is below "),
        ({"maxReplicas": 4}, 5, None, "replicas 5 is above spec.replicaSpecs.worker.maxReplicas 4"),
        ({}, 3, 2, "above the 2 workers whose certificates were issued"),
        ({"maxReplicas": 8}, 7, 6, "maxReplicas was 6 then"),
    ],
    ids=["below-min", "above-max", "above-issued", "max-raised-later"],
)
def test_a_refused_scale_names_the_field_the_value_and_what_is_allowed(
    spec: dict[str, Any], workers: int, issued: int | None, words: str
) -> None:
    why = capacity.refusal(elastic(2, **spec), workers, issued_workers=issued)
    assert why is not None
    assert words in why
    assert "spec.replicaSpecs.worker" in why
    assert "allowed " in why


def test_a_scale_within_bounds_is_not_refused() -> None:
    assert capacity.refusal(elastic(2, maxReplicas=4), 4, issued_workers=4) is None
    assert capacity.refusal(elastic(2, maxReplicas=4), 1, issued_workers=4) is None


def test_what_was_issued_is_read_back_from_the_credentials_keys() -> None:
    j = elastic(2)
    keys = ["ca.crt", "tj-ps-0.crt", "tj-worker-0.crt", "tj-worker-0.key", "tj-worker-1.crt"]
    keys += ["tj-worker-2.crt", "tj-worker-3.crt", "other-worker-9.crt"]
    assert capacity.issued_workers(keys, j) == 4


# --- the CRD's rules, offline ---------------------------------------------------------------


def test_the_ps_count_of_a_job_cannot_change_and_the_message_says_why() -> None:
    old = elastic(2)
    new = copy.deepcopy(old)
    new["spec"]["replicaSpecs"]["ps"]["replicas"] = 3
    schema.validate(new)  # a create: no transition rule
    with pytest.raises(schema.InvalidManifestError) as caught:
        schema.validate(new, old=old)
    said = str(caught.value)
    assert "spec.replicaSpecs.ps.replicas: Forbidden" in said
    assert "cannot change while the job exists" in said
    assert "sharded over the ps tasks" in said
    assert "delete the job and create it again" in said
    # the worker count may change
    schema.validate(scaled(old, 1), old=old)


@pytest.mark.parametrize(
    ("worker", "words"),
    [
        (
            {"replicas": 5, "maxReplicas": 4},
            'spec.replicaSpecs.worker.replicas: Invalid value: "object": '
            "spec.replicaSpecs.worker.replicas is above spec.replicaSpecs.worker.maxReplicas: "
            "allowed minReplicas..maxReplicas",
        ),
        (
            {"replicas": 1, "minReplicas": 2},
            'spec.replicaSpecs.worker.replicas: Invalid value: "object": '
            "spec.replicaSpecs.worker.replicas is below spec.replicaSpecs.worker.minReplicas",
        ),
        (
            {"replicas": 2, "minReplicas": 3, "maxReplicas": 2},
            'spec.replicaSpecs.worker.minReplicas: Invalid value: "object": '
            "spec.replicaSpecs.worker.minReplicas is above spec.replicaSpecs.worker.maxReplicas",
        ),
    ],
    ids=["above-max", "below-min", "min-above-max"],
)
def test_min_and_max_replicas_are_checked_as_the_apiserver_checks_them(
    worker: dict[str, Any], words: str
) -> None:
    j = job()
    j["spec"]["replicaSpecs"]["worker"] = worker
    with pytest.raises(schema.InvalidManifestError) as caught:
        schema.validate({k: v for k, v in j.items() if k != "status"})
    assert words in str(caught.value)


def test_the_crd_has_a_scale_subresource_on_the_worker_count() -> None:
    version = schema.crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicaSpecs.worker.replicas",
        "statusReplicasPath": ".status.workers.active",
        "labelSelectorPath": ".status.workers.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Workers"] == ".status.workers.summary"


# --- a pass of the planner ------------------------------------------------------------------


def test_a_scale_up_adds_the_new_indexes_and_touches_no_pod_that_runs() -> None:
    j = elastic(2, maxReplicas=4)
    step(j, [])
    first = step(j, pods(j))
    assert first.status["workers"] == {
        "desired": 2,
        "active": 2,
        "leaving": 0,
        "max": 4,
        "selector": "jaxps.dev/job-name=tj,jaxps.dev/replica-type=worker",
        "summary": "2/2",
    }
    running = pods(j)
    j = scaled(j, 4)
    result = step(j, running, network=builders.dns_network(j))
    assert workers_of(result.create) == ["tj-worker-2", "tj-worker-3"]
    assert result.delete == []
    tf = json.loads(
        next(
            e["value"]
            for e in result.create[-1]["spec"]["containers"][0]["env"]
            if e["name"] == "TF_CONFIG"
        )
    )
    assert len(tf["cluster"]["worker"]) == 4
    assert [(e.reason, e.message) for e in result.events] == [
        ("ScaledUp", "worker replicas 2 -> 4")
    ]
    again = step(j, running)
    assert [e.reason for e in again.events] == []  # one Event per change, not per pass


def test_a_scale_down_drains_the_highest_indexes_never_counting_them_as_failures() -> None:
    j = elastic(4, maxReplicas=4)
    step(j, [])
    step(j, pods(j))
    running = pods(j)
    j = scaled(j, 1)
    result = step(j, running)
    assert result.delete == ["tj-worker-3", "tj-worker-2", "tj-worker-1"]
    assert [(e.reason, e.message) for e in result.events] == [
        ("ScaledDown", "worker replicas 4 -> 1: worker-3, worker-2, worker-1 drain")
    ]
    assert result.status["workers"]["leaving"] == 3
    assert result.status["workers"]["summary"] == "1/1"
    # they drain: one exits 0, one is killed past its grace period, one is being deleted
    leaving = [
        replace(running[-1], phase="Succeeded", exit_code=0, deleting=True),
        replace(running[-2], phase="Failed", exit_code=137, deleting=True),
        replace(running[-3], deleting=True),
    ]
    after = step(j, running[:-3] + leaving)
    assert after.delete == []
    assert after.create == []
    assert after.status["restarts"] == 0
    assert "failed" not in after.status["replicaStatuses"]["worker"]  # 0: left out
    assert cond(after.status, "Failed") is None
    assert after.status["state"] == "Running"
    gone = step(j, running[:-3])
    assert gone.status["workers"]["leaving"] == 0


def test_a_leaving_worker_that_failed_before_its_pod_was_deleted_is_deleted_not_replaced() -> None:
    j = elastic(2)
    step(j, [])
    step(j, pods(j))
    j = scaled(j, 1)
    observed = [
        *pods(j),
        PodState("tj-worker-1", "worker", 1, "Failed", exit_code=1),
    ]
    result = step(j, observed)
    assert result.delete == ["tj-worker-1"]
    assert result.replaced == []
    assert result.status["restarts"] == 0


def test_a_scale_above_what_was_issued_runs_what_was_and_says_so_once() -> None:
    j = elastic(2)  # no maxReplicas: issued 2 at creation
    step(j, [], issued_workers=2)
    step(j, pods(j), issued_workers=2)
    running = pods(j)
    j = scaled(j, 5)
    result = step(j, running, issued_workers=2)
    assert workers_of(result.create) == []
    limited = cond(result.status, "ScalingLimited")
    assert limited is not None
    assert limited["status"] == "True"
    assert "spec.replicaSpecs.worker.replicas 5 is above the 2 workers" in limited["message"]
    assert "spec.replicaSpecs.worker.maxReplicas" in limited["message"]
    assert "allowed 1..2" in limited["message"]
    assert [e.reason for e in result.events] == ["ScaleRefused"]
    assert result.status["workers"]["desired"] == 2
    assert step(j, running, issued_workers=2).events == []
    back = step(scaled(j, 2), running, issued_workers=2)
    assert cond(back.status, "ScalingLimited")["status"] == "False"  # type: ignore[index]


def test_a_worker_that_stays_pending_does_not_fail_the_job_while_min_replicas_run() -> None:
    j = elastic(3, minReplicas=2)
    j["spec"]["runPolicy"]["scheduleTimeoutSeconds"] = 60
    step(j, [])
    stuck = PodState(
        "tj-worker-2",
        "worker",
        2,
        "Pending",
        waiting_reason="Unschedulable",
        waiting_message="0/1 nodes are available",
        created=NOW,
    )
    observed = [p for p in pods(j) if p.name != "tj-worker-2"] + [stuck]
    early = step(j, observed, NOW + timedelta(seconds=10))
    assert early.requeue_after is None  # no deadline for a worker it can do without
    late = step(j, observed, NOW + timedelta(seconds=120))
    assert cond(late.status, "Failed") is None
    ready = cond(late.status, "PodsReady")
    assert ready is not None
    assert "the job goes on without it" in ready["message"]
    assert [e.reason for e in late.events] == ["Unschedulable"]
    assert step(j, observed, NOW + timedelta(seconds=180)).events == []
    # below minReplicas it is needed: the timeout fails the job
    fewer = [
        p if p.name != "tj-worker-1" else replace(stuck, name="tj-worker-1", index=1)
        for p in observed
    ]
    failed = step(j, fewer, NOW + timedelta(seconds=200))
    assert cond(failed.status, "Failed") is not None


# --- reconcile: certificates and Kueue ------------------------------------------------------


def elastic_manifest(**worker: Any) -> dict[str, Any]:
    m = manifest()
    m["spec"]["replicaSpecs"]["worker"].update(worker)
    return m


def secret_keys(memory: Memory) -> list[str]:
    return sorted(k for s in memory.secrets.values() for k in s["data"])


def test_certificates_are_issued_at_creation_for_every_worker_up_to_max_replicas() -> None:
    memory = Memory(elastic_manifest(maxReplicas=4))
    Pass(memory)()
    keys = secret_keys(memory)
    assert [k for k in keys if k.endswith(".crt") and "worker" in k] == [
        f"tj-worker-{i}.crt" for i in range(4)
    ]
    (secret,) = memory.secrets.values()
    pem = base64.b64decode(secret["data"]["tj-worker-3.crt"])
    names = {
        name
        for cert in x509.load_pem_x509_certificates(pem)
        for ext in cert.extensions
        if isinstance(ext.value, x509.SubjectAlternativeName)
        for name in ext.value.get_values_for_type(x509.DNSName)
    }
    host = cluster.dns_address(job="tj", role="worker", index=3, namespace="ns", port=1)
    ca = base64.b64decode(secret["data"]["ca.crt"])
    assert credentials.server_name(ca, host.rsplit(":", 1)[0]) in names  # what peers dial


def test_a_job_without_max_replicas_cannot_grow_past_its_replicas_at_creation() -> None:
    memory = Memory(elastic_manifest())
    run = Pass(memory)
    run()
    memory.run_all()
    run()
    assert memory.job is not None
    memory.job["spec"]["replicaSpecs"]["worker"]["replicas"] = 3
    memory.job["metadata"]["generation"] += 1
    run()
    assert "tj-worker-2" not in memory.pods
    assert "ScaleRefused" in memory.reasons()
    assert memory.job["status"]["workers"]["max"] == 2


def test_scaling_up_and_down_through_reconcile_adds_and_deletes_pods() -> None:
    memory = Memory(elastic_manifest(maxReplicas=3))
    run = Pass(memory)
    run()
    memory.run_all()
    run()
    assert memory.job is not None
    memory.job["spec"]["replicaSpecs"]["worker"]["replicas"] = 3
    memory.job["metadata"]["generation"] += 1
    run()
    assert "tj-worker-2" in memory.pods
    memory.job["spec"]["replicaSpecs"]["worker"]["replicas"] = 1
    memory.job["metadata"]["generation"] += 1
    run()
    assert memory.deleted[-2:] == ["tj-worker-2", "tj-worker-1"]
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0"]
    assert memory.reasons().count("ScaledUp") == 1
    assert memory.reasons().count("ScaledDown") == 1


def test_kueue_admits_a_job_for_its_largest_size_and_a_scale_keeps_its_workload() -> None:
    j = elastic(2, maxReplicas=6)
    j["metadata"]["labels"] = {kueue.QUEUE_LABEL: "q"}
    cap = capacity.capacity(j, issued_workers=6)
    wl = kueue.workload(j, priority=kueue.Priority(), workers=cap)
    counts = {s["name"]: s["count"] for s in wl["spec"]["podSets"]}
    assert counts == {"ps": 1, "worker": 6}
    for workers in (1, 4, 6):
        later = scaled(j, workers)
        assert not kueue.stale(wl, kueue.workload(later, priority=kueue.Priority(), workers=cap))


# --- status.progress.data --------------------------------------------------------------------


def test_the_shard_queue_metrics_become_progress_data_only_where_present() -> None:
    metrics = {
        "jaxps_global_step": 40.0,
        "jaxps_data_epoch": 1.0,
        "jaxps_data_shards": 16.0,
        "jaxps_data_shards_done": 5.0,
        "jaxps_data_shards_leased": 3.0,
        "jaxps_data_leases_reclaimed_total": 2.0,
    }
    out = progress.merge({}, metrics, now=NOW)
    assert out["data"] == {
        "epoch": 1,
        "shards": 16,
        "shardsDone": 5,
        "shardsLeased": 3,
        "leasesReclaimed": 2,
    }
    partial = progress.merge({}, {"jaxps_global_step": 1.0, "jaxps_data_epoch": 0.0}, now=NOW)
    assert partial["data"] == {"epoch": 0}
    assert "data" not in progress.merge({}, {"jaxps_global_step": 1.0}, now=NOW)


# --- the local backend ----------------------------------------------------------------------


def local_job(**worker: Any) -> dict[str, Any]:
    m = elastic_manifest(**worker)
    m["metadata"] = {"name": "tj"}
    return schema.validate(m)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("worker=3", "expected worker=N@step=S, such as worker=4@step=100"),
        ("ps=3@step=5", "(only workers scale)"),
        ("worker=5@step=5", "above spec.replicaSpecs.worker.maxReplicas 4: allowed 1..4"),
        ("worker=0@step=5", "below spec.replicaSpecs.worker.minReplicas 1"),
        ("worker=3@step=999", "step 999 is past the job's last step 50"),
    ],
    ids=["no-step", "not-worker", "above-max", "below-min", "past-the-end"],
)
def test_a_bad_scale_flag_is_refused_before_the_job_starts(text: str, words: str) -> None:
    with pytest.raises(local.ScaleSpecError) as caught:
        local.Scale.parse(text, job=local_job(maxReplicas=4))
    assert words in str(caught.value)
    assert f"--scale {text!r}" in str(caught.value)


def test_a_local_job_issues_every_worker_and_scales_on_request(tmp_path: Path) -> None:
    j = local.local_job(local_job(maxReplicas=3), tmp_path)
    here = local.LocalCluster(job=j, workdir=tmp_path)
    assert here.issued_workers == 3
    assert (tmp_path / "tls" / "tj-worker-2").is_dir()
    assert here.scale(3) is None
    assert here.job["spec"]["replicaSpecs"]["worker"]["replicas"] == 3
    network = here.network(here.job)
    assert len(network.addresses["worker"]) == 3
    why = here.scale(4)
    assert why is not None
    assert "maxReplicas 3" in why
    assert here.events[-1].reason == "ScaleRefused"
    # jaxps.sdk's request file, answered on the next tick
    requests = tmp_path / local.REQUESTS_DIR
    requests.mkdir()
    (requests / "1.json").write_text(json.dumps({"workers": 1}))
    (requests / "2.json").write_text(json.dumps({"workers": 9}))
    here.answer_requests()
    assert json.loads((requests / "1.json.answer").read_text()) == {"refused": None}
    assert "maxReplicas 3" in json.loads((requests / "2.json.answer").read_text())["refused"]
    assert here.job["spec"]["replicaSpecs"]["worker"]["replicas"] == 1
    assert (
        json.loads((tmp_path / local.JOB_FILE).read_text())["spec"]["replicaSpecs"]["worker"][
            "replicas"
        ]
        == 1
    )
