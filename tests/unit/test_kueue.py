"""Kueue admission (issue 34), from the Workload up to the reconcile pass.

The Workload a TrainingJob is admitted through (`kueue.workload`), what jaxps reads of it
(`kueue.admission`), where admitted pods go (`kueue.place`), the writes that keep it true
(`kueue.actions`), the planner's gate (`policy.admission`), and whole passes of `reconcile`
against the in-memory cluster of test_reconcile and `Kueue` below, which plays Kueue's
scheduler: the tests admit, evict and re-admit as Kueue would (research/kueue.md, sections 2
and 5).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from jaxps_operator import builders, kueue, kueue_api, planner, reconcile, schema
from jaxps_operator.objects import PodState
from jaxps_operator.reconcile import ConflictError, Outcome
from tests.unit.test_planner import NOW, pods, step
from tests.unit.test_reconcile import DONE, Memory, Pass

QUEUE = "lq"
PREEMPTED_MESSAGE = (
    "Preempted to accommodate a workload (UID: w-2, JobUID: j-2) due to prioritization in the "
    "ClusterQueue"
)
PENDING_MESSAGE = (
    "couldn't assign flavors to pod set worker: insufficient unused quota for cpu in flavor "
    "default, 500m more needed"
)
FLAVORS: dict[str, dict[str, Any]] = {
    "default": {
        "nodeLabels": {"pool": "on-demand"},
        "tolerations": [
            {"key": "pool", "operator": "Equal", "value": "od", "effect": "NoSchedule"}
        ],
    },
    "spot": {
        "nodeLabels": {"pool": "spot", "lifecycle": "spot"},
        "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
    },
}


# --- builders ------------------------------------------------------------------------------------


def manifest(
    *,
    name: str = "tj",
    uid: str = "u-1",
    chief: int = 0,
    ps: int = 1,
    workers: int = 2,
    evaluator: int = 0,
    queue: str | None = QUEUE,
    labels: Mapping[str, str] | None = None,
    templates: Mapping[str, dict[str, Any]] | None = None,
    suspend: bool = False,
    run: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A TrainingJob as stored (resourceVersion included), in queue `queue` unless None;
    `run`: more of its runPolicy."""
    specs: dict[str, Any] = {}
    for role, count in (
        ("chief", chief),
        ("ps", ps),
        ("worker", workers),
        ("evaluator", evaluator),
    ):
        if count:
            specs[role] = {"replicas": count, "restartPolicy": "OnFailure"}
            if templates and role in templates:
                specs[role]["template"] = copy.deepcopy(templates[role])
    all_labels = {kueue.QUEUE_LABEL: queue} if queue else {}
    all_labels.update(labels or {})
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid,
            "generation": 1,
            "resourceVersion": 1,
            "labels": all_labels,
        },
        "spec": {
            "replicaSpecs": specs,
            "training": {"steps": 50},
            "runPolicy": {"suspend": suspend, **(run or {})},
        },
    }


def job(**kw: Any) -> dict[str, Any]:
    """`manifest(**kw)` validated, defaults applied, as a pass sees it."""
    validated = schema.validate(manifest(**kw))
    validated["status"] = {}
    return validated


def set_condition(wl: dict[str, Any], type_: str, status: str, reason: str, msg: str = "") -> None:
    """Sets a condition of a Workload as Kueue does (all five fields)."""
    conditions = wl.setdefault("status", {}).setdefault("conditions", [])
    new = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": msg,
        "lastTransitionTime": "2026-11-21T11:00:00Z",
        "observedGeneration": int(wl["metadata"].get("generation", 1)),
    }
    for i, c in enumerate(conditions):
        if c["type"] == type_:
            conditions[i] = new
            return
    conditions.append(new)


def get_condition(wl: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (wl.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return None


def admit(wl: dict[str, Any], flavor: str = "default", cluster_queue: str = "cq") -> None:
    """What Kueue's scheduler writes when it admits `wl` (`SetQuotaReservation`,
    `SyncAdmittedCondition`): every pod set on `flavor`, Evicted and Preempted reset."""
    wl.setdefault("status", {})["admission"] = {
        "clusterQueue": cluster_queue,
        "podSetAssignments": [
            {"name": p["name"], "flavors": {"cpu": flavor, "memory": flavor}, "count": p["count"]}
            for p in wl["spec"]["podSets"]
        ],
    }
    set_condition(
        wl, "QuotaReserved", "True", "QuotaReserved", f"Quota reserved in {cluster_queue}"
    )
    set_condition(wl, "Admitted", "True", "Admitted", "The workload is admitted")
    for type_ in ("Evicted", "Preempted"):
        if (c := get_condition(wl, type_)) is not None and c["status"] == "True":
            set_condition(wl, type_, "False", "QuotaReserved", "Previously: " + c["message"])


def evict(wl: dict[str, Any], reason: str = "Preempted", preempted: str = "InClusterQueue") -> None:
    """What Kueue writes when it evicts `wl` (`prepareForEviction`): Evicted (and Preempted on a
    preemption) True, while QuotaReserved and Admitted stay True."""
    message = PREEMPTED_MESSAGE if reason == "Preempted" else f"The workload is {reason}"
    set_condition(wl, "Evicted", "True", reason, message)
    if reason == "Preempted":
        set_condition(wl, "Preempted", "True", preempted, message)


def stored(
    j: Mapping[str, Any],
    *,
    priority: kueue.Priority | None = None,
    admitted: bool = False,
    evicted: str | None = None,
    finished: str | None = None,
    deleting: bool = False,
    finalizer: bool = True,
    reclaimable: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The job's Workload as the API server would return it, in the state asked for."""
    wl = kueue.workload(j, priority=priority or kueue.Priority())
    wl["metadata"].update(resourceVersion="7", generation=1, uid="wl-uid")
    if not finalizer:
        wl["metadata"]["finalizers"] = []
    if deleting:
        wl["metadata"]["deletionTimestamp"] = "2026-11-21T11:30:00Z"
    wl["status"] = {}
    if admitted:
        admit(wl)
    if evicted:
        evict(wl, evicted)
    if finished:
        set_condition(wl, "Finished", "True", finished, "")
    if reclaimable is not None:
        wl["status"]["reclaimablePods"] = reclaimable
    return wl


def admission_of(j: Mapping[str, Any], wl: Mapping[str, Any] | None) -> kueue.Admission:
    desired = kueue.workload(j, priority=kueue.Priority())
    return kueue.admission(j, wl, desired=desired, flavors=FLAVORS)


def actions_for(
    j: Mapping[str, Any],
    wl: Mapping[str, Any] | None,
    observed: list[PodState],
    *,
    state: str = "Running",
) -> list[kueue.Action]:
    return kueue.actions(
        j,
        state=state,
        wl=wl,
        desired=kueue.workload(j, priority=kueue.Priority()),
        pods=observed,
        now=NOW,
    )


def status_conditions(body: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """type -> (status, reason) of a Workload body's conditions."""
    return {c["type"]: (c["status"], c["reason"]) for c in body["status"].get("conditions", [])}


def cond(status: Mapping[str, Any], type_: str) -> dict[str, Any]:
    found = [c for c in status.get("conditions", []) if c["type"] == type_]
    assert found, f"no {type_} condition in {status}"
    return dict(found[0])


# --- 1. the Workload -----------------------------------------------------------------------------


def kueue_hash(name: str, uid: str) -> str:
    """Kueue's `getHash` (jobframework/workload_names.go) for a TrainingJob."""
    return hashlib.sha1(f"TrainingJob\njaxps.dev\n{name}\n{uid}".encode()).hexdigest()[:5]


def test_the_workload_name_is_kueues_scheme_for_a_trainingjob() -> None:
    j = job(name="mnist", uid="0b5c7a52-1111-4e2e-9c6a-4c3f6b5a1d2e")
    name = kueue.workload_name(j)
    assert name == f"trainingjob-mnist-{kueue_hash('mnist', j['metadata']['uid'])}"
    assert kueue.workload(j, priority=kueue.Priority())["metadata"]["name"] == name


def test_a_long_job_name_is_cut_to_253_characters_with_the_hash_of_the_whole_name() -> None:
    long = "a" * 250
    j = job(name="x")
    j["metadata"]["name"] = long  # the API allows 253; the pass never validates the name
    name = kueue.workload_name(j)
    assert len(name) == 253
    assert name == ("trainingjob-" + long)[:247] + "-" + kueue_hash(long, "u-1")


def test_the_workload_is_labelled_finalized_and_owned_by_its_job() -> None:
    j = job(name="tj", uid="u-9")
    wl = kueue.workload(j, priority=kueue.Priority())
    assert (wl["apiVersion"], wl["kind"]) == ("kueue.x-k8s.io/v1beta2", "Workload")
    meta = wl["metadata"]
    assert meta["namespace"] == "ns"
    assert meta["labels"] == {builders.LABEL_JOB: "tj", "kueue.x-k8s.io/job-uid": "u-9"}
    assert meta["finalizers"] == ["kueue.x-k8s.io/resource-in-use"]
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "jaxps.dev/v1alpha1",
            "kind": "TrainingJob",
            "name": "tj",
            "uid": "u-9",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert wl["spec"]["queueName"] == QUEUE
    assert wl["spec"]["active"] is True
    assert "priorityClassRef" not in wl["spec"]
    assert "priority" not in wl["spec"]


def test_one_pod_set_per_role_in_order_with_its_replicas_and_real_resources() -> None:
    requests = {"cpu": "500m", "memory": "1Gi"}
    templates = {
        "ps": {
            "spec": {
                "containers": [
                    {"name": "main", "resources": {"requests": {"cpu": 1, "memory": "2Gi"}}},
                    {
                        "name": "side",
                        "image": "busybox:1.36",
                        "resources": {"limits": {"cpu": "100m", "memory": "64Mi"}},
                    },
                ],
                "nodeSelector": {"disk": "ssd"},
                "tolerations": [{"key": "ps", "operator": "Exists", "effect": "NoSchedule"}],
                "priorityClassName": "high",
            }
        },
        "worker": {
            "spec": {
                "containers": [
                    {"name": "jaxps", "image": "me/runtime:2", "resources": {"requests": requests}}
                ]
            }
        },
        "evaluator": {"spec": {"containers": []}},  # no container: the default one
    }
    j = job(chief=1, ps=2, workers=3, evaluator=1, templates=templates)
    sets = kueue.workload(j, priority=kueue.Priority())["spec"]["podSets"]
    assert [(s["name"], s["count"]) for s in sets] == [
        ("chief", 1),
        ("ps", 2),
        ("worker", 3),
        ("evaluator", 1),
    ]
    by_role = {s["name"]: s["template"]["spec"] for s in sets}
    default = [{"name": "jaxps", "image": builders.DEFAULT_IMAGE}]
    assert by_role["chief"] == {"containers": default}
    assert by_role["evaluator"] == {"containers": default}
    assert by_role["worker"] == {
        "containers": [
            {"name": "jaxps", "image": "me/runtime:2", "resources": {"requests": requests}}
        ]
    }
    ps = by_role["ps"]
    assert ps["containers"] == [
        {
            "name": "main",
            "image": builders.DEFAULT_IMAGE,
            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},  # as text for the CRD
        },
        {
            "name": "side",
            "image": "busybox:1.36",
            "resources": {"limits": {"cpu": "100m", "memory": "64Mi"}},
        },
    ]
    assert ps["nodeSelector"] == {"disk": "ssd"}
    assert ps["tolerations"] == [{"key": "ps", "operator": "Exists", "effect": "NoSchedule"}]
    assert ps["priorityClassName"] == "high"


def test_the_workload_does_not_share_the_jobs_template() -> None:
    templates = {"worker": {"spec": {"containers": [{"resources": {"requests": {"cpu": "1"}}}]}}}
    j = job(templates=templates)
    wl = kueue.workload(j, priority=kueue.Priority())
    wl["spec"]["podSets"][1]["template"]["spec"]["containers"][0]["resources"]["requests"][
        "cpu"
    ] = "9"
    container = j["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"] == "1"


def test_the_priority_class_becomes_the_workloads_ref_and_value() -> None:
    j = job()
    wl = kueue.workload(
        j, priority=kueue.Priority(1000, "kueue.x-k8s.io", "WorkloadPriorityClass", "high")
    )
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "high",
    }
    assert wl["spec"]["priority"] == 1000


def test_a_suspended_job_asks_for_an_inactive_workload() -> None:
    wl = kueue.workload(job(suspend=True), priority=kueue.Priority())
    assert wl["spec"]["active"] is False


def test_a_job_without_the_queue_label_is_not_kueues() -> None:
    assert kueue.queue_name(job(queue=None)) is None
    assert kueue.queue_name(job(queue=None, labels={kueue.QUEUE_LABEL: ""})) is None
    assert kueue.queue_name(job()) == QUEUE


def test_a_sidecar_init_container_keeps_its_restart_policy() -> None:
    sidecar = {
        "name": "proxy",
        "image": "envoy:1",
        "restartPolicy": "Always",
        "resources": {"requests": {"cpu": "1"}},
    }
    templates = {"worker": {"spec": {"initContainers": [sidecar], "containers": [{}]}}}
    sets = kueue.workload(job(templates=templates), priority=kueue.Priority())["spec"]["podSets"]
    worker = next(s for s in sets if s["name"] == "worker")
    assert worker["template"]["spec"]["initContainers"][0]["restartPolicy"] == "Always"


def test_every_quantity_in_a_pod_set_is_an_integer_or_text() -> None:
    templates = {"worker": {"spec": {"containers": [{"resources": {"requests": {"cpu": 0.5}}}]}}}
    sets = kueue.workload(job(templates=templates), priority=kueue.Priority())["spec"]["podSets"]
    worker = next(s for s in sets if s["name"] == "worker")
    cpu = worker["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    assert isinstance(cpu, int | str)


# --- 2. priority_source --------------------------------------------------------------------------


def test_the_priority_label_wins_over_a_templates_priority_class_name() -> None:
    templates = {"worker": {"spec": {"priorityClassName": "pods-high", "containers": [{}]}}}
    j = job(labels={kueue.PRIORITY_LABEL: "wl-high"}, templates=templates)
    assert kueue.priority_source(j) == ("kueue.x-k8s.io", "WorkloadPriorityClass", "wl-high")


def test_without_the_label_the_first_templates_priority_class_name_is_the_source() -> None:
    templates = {
        "ps": {"spec": {"priorityClassName": "ps-class", "containers": [{}]}},
        "worker": {"spec": {"priorityClassName": "worker-class", "containers": [{}]}},
    }
    assert kueue.priority_source(job(templates=templates)) == (
        "scheduling.k8s.io",
        "PriorityClass",
        "ps-class",
    )


def test_no_label_and_no_priority_class_name_is_no_source() -> None:
    assert kueue.priority_source(job()) is None


# --- 3. admission(): what Kueue says -------------------------------------------------------------


def test_no_workload_yet_may_not_run() -> None:
    a = admission_of(job(), None)
    assert (a.exists, a.may_run) == (False, False)
    assert a.queue == QUEUE
    assert a.workload == kueue.workload_name(job())


def test_a_pending_workload_says_why_in_kueues_words() -> None:
    j = job()
    wl = stored(j)
    set_condition(wl, "QuotaReserved", "False", "Pending", PENDING_MESSAGE)
    a = admission_of(j, wl)
    assert a.exists
    assert not a.may_run
    assert a.pending == ("Pending", PENDING_MESSAGE)
    assert not a.reserved
    assert not a.admitted


def test_an_admitted_workload_runs_on_its_flavors_node_labels_and_tolerations() -> None:
    j = job()
    wl = stored(j, admitted=True)
    wl["status"]["admission"]["podSetAssignments"][1]["flavors"] = {"cpu": "spot", "memory": "spot"}
    a = admission_of(j, wl)
    assert a.may_run
    assert a.reserved
    assert a.admitted
    assert a.cluster_queue == "cq"
    assert a.placement["ps"] == kueue.Placement(
        {"pool": "on-demand"}, tuple(FLAVORS["default"]["tolerations"]), ("default",)
    )
    assert a.placement["worker"] == kueue.Placement(
        {"pool": "spot", "lifecycle": "spot"}, tuple(FLAVORS["spot"]["tolerations"]), ("spot",)
    )
    assert a.flavors() == "default, spot"


def test_a_pod_set_on_two_flavors_gets_both_labels_and_tolerations_once() -> None:
    j = job()
    wl = stored(j, admitted=True)
    wl["status"]["admission"]["podSetAssignments"][1]["flavors"] = {
        "cpu": "spot",
        "memory": "default",
    }
    flavors = {
        "default": FLAVORS["default"],
        "spot": {  # it tolerates the default flavor's taint too
            **FLAVORS["spot"],
            "tolerations": FLAVORS["spot"]["tolerations"] + FLAVORS["default"]["tolerations"],
        },
    }
    desired = kueue.workload(j, priority=kueue.Priority())
    placement = kueue.admission(j, wl, desired=desired, flavors=flavors).placement["worker"]
    assert placement.flavors == ("default", "spot")
    assert placement.node_labels == {"pool": "spot", "lifecycle": "spot"}
    assert len(placement.tolerations) == 2


def test_an_evicted_workload_still_admitted_may_not_run() -> None:
    j = job()
    a = admission_of(j, stored(j, admitted=True, evicted="Preempted"))
    assert a.admitted
    assert a.reserved
    assert not a.may_run
    assert a.evicted == ("Preempted", PREEMPTED_MESSAGE)
    assert a.preempted == ("InClusterQueue", PREEMPTED_MESSAGE)


def test_a_deleted_workload_may_not_run() -> None:
    j = job()
    a = admission_of(j, stored(j, admitted=True, deleting=True))
    assert a.deleting
    assert not a.may_run


def test_a_finished_workload_may_not_run() -> None:
    j = job()
    assert not admission_of(j, stored(j, admitted=True, finished="Succeeded")).may_run


def test_a_workload_of_other_replica_counts_is_stale_and_may_not_run() -> None:
    wl = stored(job(workers=2), admitted=True)
    a = admission_of(job(workers=3), wl)
    assert a.stale
    assert not a.may_run


def test_a_workload_of_another_queue_is_stale() -> None:
    wl = stored(job(queue="other"), admitted=True)
    assert admission_of(job(), wl).stale


def test_what_the_api_server_and_kueues_webhook_add_is_not_a_change() -> None:
    templates = {
        "worker": {"spec": {"containers": [{"resources": {"requests": {"cpu": 1}}}, {"name": "b"}]}}
    }
    j = job(templates=templates)
    wl = stored(j, admitted=True)
    for pod_set in wl["spec"]["podSets"]:
        pod_set["template"]["metadata"] = {"creationTimestamp": None}
        for c in pod_set["template"]["spec"]["containers"]:
            c.setdefault("resources", {})
    worker = wl["spec"]["podSets"][1]["template"]["spec"]
    worker["containers"][0]["resources"]["requests"]["cpu"] = "1"  # 1 encoded as a quantity
    a = admission_of(j, wl)
    assert not a.stale
    assert a.may_run


def test_quantities_written_in_kueues_canonical_form_are_not_a_change() -> None:
    requests = {"cpu": "1000m", "memory": "1024Mi"}
    limits = {"cpu": "0.5", "memory": "1.5Gi"}
    templates = {
        "worker": {
            "spec": {"containers": [{"resources": {"requests": requests, "limits": limits}}]}
        }
    }
    j = job(templates=templates)
    wl = stored(j, admitted=True)
    worker = wl["spec"]["podSets"][1]["template"]["spec"]["containers"][0]["resources"]
    worker["requests"] = {"cpu": "1", "memory": "1Gi"}  # resource.Quantity's MarshalJSON
    worker["limits"] = {"cpu": "500m", "memory": "1536Mi"}
    assert not admission_of(j, wl).stale


def test_a_problem_keeps_the_job_from_running() -> None:
    j = job()
    desired = kueue.workload(j, priority=kueue.Priority())
    a = kueue.admission(j, stored(j, admitted=True), desired=desired, problem="no Kueue")
    assert not a.may_run


# --- 4. place(): pods on the flavors -------------------------------------------------------------


def test_place_merges_the_flavors_labels_over_the_templates_and_adds_tolerations_once() -> None:
    mine = {"key": "pool", "operator": "Equal", "value": "od", "effect": "NoSchedule"}
    templates = {
        "worker": {
            "spec": {
                "containers": [{}],
                "nodeSelector": {"pool": "mine", "disk": "ssd"},
                "tolerations": [mine],
            }
        }
    }
    j = job(templates=templates)
    pod = builders.pod(j, "worker", 0, network=builders.dns_network(j))
    extra = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
    placed = kueue.place(
        pod, kueue.Placement({"pool": "spot"}, (dict(mine), extra), ("spot",)), "worker"
    )
    assert placed["spec"]["nodeSelector"] == {"pool": "spot", "disk": "ssd"}
    assert placed["spec"]["tolerations"] == [mine, extra]
    assert placed["metadata"]["labels"][kueue.PODSET_LABEL] == "worker"
    assert placed["metadata"]["labels"][builders.LABEL_ROLE] == "worker"


def test_place_without_a_placement_only_labels_the_pod_set() -> None:
    j = job()
    pod = builders.pod(j, "ps", 0, network=builders.dns_network(j))
    before = copy.deepcopy(pod["spec"])
    placed = kueue.place(pod, None, "ps")
    assert placed["spec"] == before
    assert placed["metadata"]["labels"][kueue.PODSET_LABEL] == "ps"


# --- 5. actions(): keeping the Workload true -----------------------------------------------------


def test_a_queued_job_with_no_workload_and_no_pod_creates_it() -> None:
    j = job()
    [action] = actions_for(j, None, [], state="Queued")
    assert action.verb == "create"
    assert action.body == kueue.workload(j, priority=kueue.Priority())


def test_no_workload_is_created_while_a_pod_of_the_job_is_active() -> None:
    j = job()
    assert actions_for(j, None, pods(j, "Running")) == []
    assert actions_for(j, None, pods(j, "Pending")) == []
    leaving = [dataclasses.replace(p, deleting=True, phase="Succeeded") for p in pods(j)]
    assert actions_for(j, None, leaving) == []


def test_a_finished_job_with_no_workload_gets_none() -> None:
    j = job()
    assert actions_for(j, None, [], state="Succeeded") == []
    assert actions_for(j, None, [], state="Failed") == []


def test_an_evicted_workload_keeps_its_reservation_while_pods_are_left() -> None:
    j = job()
    wl = stored(j, admitted=True, evicted="Preempted")
    assert actions_for(j, wl, pods(j, "Running"), state="Preempted") == []
    leaving = [dataclasses.replace(p, deleting=True) for p in pods(j, "Running")][-1:]
    assert actions_for(j, wl, leaving, state="Preempted") == []


@pytest.mark.parametrize(
    ("reason", "requeued"),
    [("Preempted", "True"), ("NodeFailures", "True"), ("Deactivated", "False")],
    ids=["preempted-requeued", "node-failures-requeued", "deactivated-parked"],
)
def test_an_evicted_workload_with_no_pod_left_gives_its_reservation_back(
    reason: str, requeued: str
) -> None:
    j = job()
    wl = stored(j, admitted=True, evicted=reason)
    done = [dataclasses.replace(p, phase="Failed", exit_code=143) for p in pods(j)]
    for observed in ([], done):  # ended pods hold nothing
        [action] = actions_for(j, wl, observed, state="Preempted")
        assert action.verb == "status"
        body = action.body
        conditions = status_conditions(body)
        assert conditions["QuotaReserved"] == ("False", "Pending")
        assert conditions["Admitted"] == ("False", "NoReservation")
        assert conditions["Requeued"] == (requeued, reason)
        assert conditions["Evicted"] == ("True", reason)  # Kueue resets it at re-admission
        assert "admission" not in body["status"]
        reserved, evicted = get_condition(body, "QuotaReserved"), get_condition(wl, "Evicted")
        assert reserved is not None
        assert evicted is not None
        assert reserved["message"] == evicted["message"]
        for c in body["status"]["conditions"]:
            assert set(c) >= {"type", "status", "reason", "message", "lastTransitionTime"}
        assert body["metadata"]["resourceVersion"] == "7"  # guarded by what was read
    assert "admission" in wl["status"]  # the Workload read is left as it was


def test_a_released_workload_is_not_released_again() -> None:
    j = job()
    wl = stored(j, admitted=True, evicted="Preempted")
    [action] = actions_for(j, wl, [], state="Preempted")
    assert actions_for(j, action.body, [], state="Preempted") == []


def test_a_released_workload_claims_no_reclaimable_pods() -> None:
    j = job(workers=3)
    wl = stored(j, admitted=True, evicted="Preempted", reclaimable=[{"name": "worker", "count": 1}])
    [action] = actions_for(j, wl, [], state="Preempted")
    assert not action.body["status"].get("reclaimablePods")


@pytest.mark.parametrize("state", ["Succeeded", "Failed"])
def test_a_finished_job_finishes_its_workload_then_drops_the_finalizer(state: str) -> None:
    j = job()
    j["status"] = {
        "conditions": [
            {"type": state, "status": "True", "reason": "X", "message": "worker 0 ended it"}
        ]
    }
    wl = stored(j, admitted=True)
    [action] = actions_for(j, wl, pods(j, "Running"), state=state)
    assert action.verb == "status"
    finished = get_condition(action.body, "Finished")
    assert finished is not None
    assert (finished["status"], finished["reason"], finished["message"]) == (
        "True",
        state,
        "worker 0 ended it",
    )
    [action] = actions_for(j, action.body, pods(j, "Running"), state=state)
    assert action.verb == "update"
    assert action.body["metadata"]["finalizers"] == []
    assert actions_for(j, action.body, [], state=state) == []


def test_a_deleted_workload_loses_its_finalizer_only_once_the_pods_are_gone() -> None:
    j = job()
    wl = stored(j, admitted=True, deleting=True)
    assert actions_for(j, wl, pods(j, "Running")) == []
    [action] = actions_for(j, wl, [], state="Queued")
    assert action.verb == "update"
    assert kueue.FINALIZER not in action.body["metadata"]["finalizers"]
    assert actions_for(j, stored(j, deleting=True, finalizer=False), []) == []


def test_a_stale_workload_without_a_reservation_is_updated_in_place() -> None:
    wl = stored(job(workers=2))
    j = job(workers=4)
    [action] = actions_for(j, wl, [], state="Queued")
    assert action.verb == "update"
    assert [s["count"] for s in action.body["spec"]["podSets"]] == [1, 4]
    assert action.body["metadata"]["resourceVersion"] == "7"


def test_a_stale_reserved_workload_is_replaced_once_the_pods_are_gone() -> None:
    wl = stored(job(workers=2), admitted=True)
    j = job(workers=4)
    assert actions_for(j, wl, pods(job(workers=2), "Running"), state="Preempted") == []
    [action] = actions_for(j, wl, [], state="Preempted")
    assert action.verb == "delete"


@pytest.mark.parametrize("suspend", [True, False], ids=["suspended", "resumed"])
def test_suspend_is_the_workloads_active_field(suspend: bool) -> None:
    wl = stored(job(suspend=not suspend))
    j = job(suspend=suspend)
    [action] = actions_for(j, wl, [], state="Suspended" if suspend else "Queued")
    assert action.verb == "update"
    assert action.body["spec"]["active"] is (not suspend)


def succeeded(j: dict[str, Any], *names: str) -> list[PodState]:
    return [
        dataclasses.replace(p, phase="Succeeded", ready=False, exit_code=0)
        if p.name in names
        else p
        for p in pods(j, "Running")
    ]


def test_workers_done_for_good_release_their_quota() -> None:
    j = job(workers=3, evaluator=1)
    wl = stored(j, admitted=True)
    [action] = actions_for(j, wl, succeeded(j, "tj-worker-1", "tj-worker-2", "tj-ps-0"))
    assert action.verb == "status"
    assert action.body["status"]["reclaimablePods"] == [{"name": "worker", "count": 2}]
    assert actions_for(j, action.body, succeeded(j, "tj-worker-1", "tj-worker-2")) == []


def test_reclaimable_pods_never_decrease_nor_exceed_the_count_nor_name_the_ps() -> None:
    j = job(workers=2, evaluator=1)
    wl = stored(j, admitted=True, reclaimable=[{"name": "worker", "count": 2}])
    # the Succeeded pods were deleted since: the count stays
    assert actions_for(j, wl, pods(j, "Running")) == []
    more = succeeded(j, "tj-worker-0", "tj-worker-1", "tj-evaluator-0", "tj-ps-0")
    more.append(dataclasses.replace(more[1], name="tj-worker-1-old"))  # a third, older worker
    [action] = actions_for(j, wl, more)
    assert action.body["status"]["reclaimablePods"] == [
        {"name": "evaluator", "count": 1},
        {"name": "worker", "count": 2},
    ]


def test_an_unreserved_workload_reports_no_reclaimable_pods() -> None:
    j = job()
    assert actions_for(j, stored(j), succeeded(j, "tj-worker-1"), state="Queued") == []


# --- 6. the planner's gate -----------------------------------------------------------------------

QUEUED = kueue.Admission(
    queue=QUEUE, workload="trainingjob-tj-x", exists=True, pending=("Pending", PENDING_MESSAGE)
)
ADMITTED = kueue.Admission(
    queue=QUEUE,
    workload="trainingjob-tj-x",
    exists=True,
    reserved=True,
    admitted=True,
    cluster_queue="cq",
    placement={
        role: kueue.Placement(
            FLAVORS["spot"]["nodeLabels"], tuple(FLAVORS["spot"]["tolerations"]), ("spot",)
        )
        for role in builders.ROLES
    },
)
EVICTED = dataclasses.replace(
    ADMITTED,
    evicted=("Preempted", PREEMPTED_MESSAGE),
    preempted=("InClusterQueue", PREEMPTED_MESSAGE),
)


def created_pods(result: planner.Plan) -> list[dict[str, Any]]:
    return [m for m in result.create if m["kind"] == "Pod"]


def test_a_queued_job_gets_no_pod_but_its_service_and_waits_in_kueues_words() -> None:
    j = job(chief=1, evaluator=1)
    result = step(j, [], service_exists=False, credentials={"ca.crt": b"x"}, admission=QUEUED)
    assert [m["kind"] for m in result.create] == ["Service", "Secret"]
    assert result.delete == []
    assert result.status["state"] == "Queued"
    queued = cond(result.status, "Queued")
    assert (queued["status"], queued["reason"], queued["message"]) == (
        "True",
        "Pending",
        PENDING_MESSAGE,
    )
    assert "startTime" not in result.status  # the deadline counts from the admission
    assert "Queued" in [e.reason for e in result.events]
    again = step(j, [], admission=QUEUED)
    assert again.create == []
    assert "Queued" not in [e.reason for e in again.events]


def test_a_job_with_no_workload_yet_says_so() -> None:
    j = job()
    result = step(j, [], admission=admission_of(j, None))
    assert created_pods(result) == []
    assert cond(result.status, "Queued")["reason"] == "WorkloadCreated"
    assert kueue.workload_name(j) in cond(result.status, "Queued")["message"]


def test_an_admitted_job_gets_every_pod_on_its_flavor() -> None:
    j = job(chief=1, ps=2, workers=2, evaluator=1)
    step(j, [], admission=QUEUED)
    result = step(j, [], admission=ADMITTED)
    made = created_pods(result)
    assert len(made) == 6
    for pod in made:
        assert pod["spec"]["nodeSelector"] == FLAVORS["spot"]["nodeLabels"]
        assert pod["spec"]["tolerations"] == FLAVORS["spot"]["tolerations"]
        role = pod["metadata"]["labels"][builders.LABEL_ROLE]
        assert pod["metadata"]["labels"][kueue.PODSET_LABEL] == role
    assert result.status["state"] != "Queued"
    admitted = cond(result.status, "Admitted")
    assert admitted["status"] == "True"
    assert "ClusterQueue cq" in admitted["message"]
    assert "spot" in admitted["message"]
    assert cond(result.status, "Queued")["status"] == "False"
    assert "startTime" in result.status
    assert "Admitted" in [e.reason for e in result.events]


def running(j: dict[str, Any]) -> None:
    """Brings `j` to an admitted, running job."""
    step(j, [], admission=ADMITTED)
    step(j, pods(j, "Running"), admission=ADMITTED)
    assert j["status"]["state"] == "Running"


def test_an_evicted_job_stops_the_chief_and_workers_first_and_the_ps_last() -> None:
    j = job(chief=1, ps=2, workers=2, evaluator=1)
    running(j)
    everyone = pods(j, "Running")
    ps = {p.name for p in everyone if p.role == "ps"}
    result = step(j, everyone, admission=EVICTED)
    assert set(result.delete) == {p.name for p in everyone} - ps
    assert created_pods(result) == []
    assert result.status["state"] == "Preempted"
    preempted = cond(result.status, "Preempted")
    assert (preempted["status"], preempted["reason"]) == ("True", "Preempted")
    assert PREEMPTED_MESSAGE in preempted["message"]
    assert "InClusterQueue" in preempted["message"]
    assert cond(result.status, "Admitted")["status"] == "False"
    assert cond(result.status, "Running")["status"] == "False"
    assert not any(c["type"] == "Failed" for c in result.status["conditions"])
    assert result.replaced == []
    assert result.status["restarts"] == 0

    # the chief and workers are leaving: the ps keep serving the chief's last checkpoint
    leaving = [dataclasses.replace(p, deleting=True) if p.name not in ps else p for p in everyone]
    result = step(j, leaving, admission=EVICTED)
    assert result.delete == []
    assert result.create == []
    one_left = [p for p in everyone if p.name in ps or p.name == "tj-worker-1"]
    assert step(j, one_left, admission=EVICTED).delete == ["tj-worker-1"]

    # they are gone: now the ps
    only_ps = [p for p in everyone if p.name in ps]
    result = step(j, only_ps, admission=EVICTED)
    assert sorted(result.delete) == sorted(ps)
    assert result.status["state"] == "Preempted"
    assert step(j, [], admission=EVICTED).delete == []


def test_a_readmitted_job_gets_its_pods_again_and_is_no_longer_preempted() -> None:
    j = job()
    running(j)
    step(j, pods(j, "Running"), admission=EVICTED)
    step(j, [], admission=EVICTED)
    result = step(j, [], admission=ADMITTED)
    assert len(created_pods(result)) == 3
    assert result.status["state"] not in ("Preempted", "Queued")
    assert cond(result.status, "Preempted")["status"] == "False"
    assert cond(result.status, "Preempted")["reason"] == "Readmitted"
    assert cond(result.status, "Admitted")["status"] == "True"
    result = step(j, pods(j, "Running"), admission=ADMITTED)
    assert result.status["state"] == "Running"


def test_the_deadline_counts_from_the_readmission() -> None:
    j = job(run={"activeDeadlineSeconds": 600})
    step(j, [], NOW, admission=ADMITTED)
    step(j, pods(j, "Running"), NOW + timedelta(seconds=30), admission=ADMITTED)
    step(j, pods(j, "Running"), NOW + timedelta(seconds=60), admission=EVICTED)
    step(j, [], NOW + timedelta(seconds=90), admission=EVICTED)
    result = step(j, [], NOW + timedelta(hours=2), admission=ADMITTED)
    assert result.status["state"] != "Failed"
    assert len(created_pods(result)) == 3


def test_a_workload_deleted_under_a_running_job_stops_it_as_a_preemption() -> None:
    j = job()
    running(j)
    result = step(j, pods(j, "Running"), admission=dataclasses.replace(ADMITTED, deleting=True))
    assert sorted(result.delete) == ["tj-worker-0", "tj-worker-1"]
    assert cond(result.status, "Preempted")["reason"] == "WorkloadDeleted"


def test_a_job_not_in_a_queue_is_planned_as_before() -> None:
    j = job(queue=None)
    result = step(j, [])
    assert len(created_pods(result)) == 3
    for pod in created_pods(result):
        assert kueue.PODSET_LABEL not in pod["metadata"]["labels"]
        assert "nodeSelector" not in pod["spec"]
    assert not any(c["type"] in ("Queued", "Admitted") for c in result.status["conditions"])


# --- 7. reconcile: whole passes against Kueue in memory -----------------------------------------


@dataclass
class Nodes(Memory):
    """`Memory` whose pods leave gracefully: a deleted pod stays, `deleting`, until `gone()`;
    it keeps each pod's manifest, to read where it was placed."""

    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)

    def create(self, job: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
        made = super().create(job, manifest)
        if made and manifest["kind"] == "Pod":
            self.manifests[manifest["metadata"]["name"]] = copy.deepcopy(dict(manifest))
        return made

    def delete_pod(self, job: Mapping[str, Any], name: str, *, force: bool = False) -> bool:
        self.deleted.append(name)
        p = self.pods.get(name)
        if p is None or p.deleting:
            return p is not None
        self.pods[name] = dataclasses.replace(p, deleting=True, ready=False)
        return True

    def gone(self) -> None:
        """The kubelet is done with every pod that was deleted."""
        self.pods = {n: p for n, p in self.pods.items() if not p.deleting}


@dataclass
class Kueue:
    """`reconcile.Workloads` in memory, as the API server keeps Workloads (resourceVersion
    guards, finalizers hold a deletion); the tests play Kueue's scheduler on it."""

    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    classes: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, name) -> value
    flavor_specs: dict[str, dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(FLAVORS))
    unavailable: str = ""  # Kueue's API is missing: get raises, writes fail
    writes: list[tuple[str, str]] = field(default_factory=list)  # (verb, why)
    refused: list[str] = field(default_factory=list)  # writes while unavailable
    version: int = 0

    def _next(self) -> str:
        self.version += 1
        return str(self.version)

    def get(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        if self.unavailable:
            raise kueue.UnavailableError(self.unavailable)
        found = self.workloads.get(kueue.workload_name(job))
        return copy.deepcopy(found) if found is not None else None

    def priority(self, group: str, kind: str, name: str) -> int | None:
        return self.classes.get((kind, name))

    def flavors(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        return {n: copy.deepcopy(self.flavor_specs[n]) for n in names if n in self.flavor_specs}

    def orphans(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(wl)
            for wl in self.workloads.values()
            if wl["metadata"]["labels"].get(builders.LABEL_JOB) == name
            and kueue.FINALIZER in (wl["metadata"].get("finalizers") or [])
        ]

    def apply(self, action: kueue.Action) -> None:
        if self.unavailable:  # the real client gets a 404 here
            self.refused.append(action.verb)
            return
        self.writes.append((action.verb, action.why))
        body = copy.deepcopy(action.body)
        name = body["metadata"]["name"]
        if action.verb == "create":
            assert name not in self.workloads, "created twice"
            body["metadata"].update(resourceVersion=self._next(), generation=1)
            for pod_set in body["spec"]["podSets"]:  # what the API server's round trip adds
                pod_set["template"]["metadata"] = {"creationTimestamp": None}
                for c in pod_set["template"]["spec"]["containers"]:
                    c.setdefault("resources", {})
            body["status"] = {}
            self.workloads[name] = body
            return
        have = self.workloads[name]
        if body["metadata"]["resourceVersion"] != have["metadata"]["resourceVersion"]:
            raise ConflictError(f"Workload {name} changed")
        if action.verb == "delete":
            if have["metadata"].get("finalizers"):
                have["metadata"]["deletionTimestamp"] = "2026-11-23T09:00:00Z"
                have["metadata"]["resourceVersion"] = self._next()
            else:
                del self.workloads[name]
            return
        if action.verb == "status":
            have["status"] = body["status"]
        else:
            assert action.verb == "update", action.verb
            if body["spec"] != have["spec"]:
                have["metadata"]["generation"] += 1
            have["spec"] = body["spec"]
            have["metadata"]["finalizers"] = body["metadata"].get("finalizers") or []
        have["metadata"]["resourceVersion"] = self._next()
        if have["metadata"].get("deletionTimestamp") and not have["metadata"]["finalizers"]:
            del self.workloads[name]

    # --- Kueue's moves -------------------------------------------------------------------------

    def only(self) -> dict[str, Any]:
        assert len(self.workloads) == 1, list(self.workloads)
        return next(iter(self.workloads.values()))

    def _moved(self, change: Any) -> None:
        wl = self.only()
        change(wl)
        wl["metadata"]["resourceVersion"] = self._next()

    def admit(self, flavor: str = "spot") -> None:
        self._moved(lambda wl: admit(wl, flavor))

    def evict(self, reason: str = "Preempted") -> None:
        self._moved(lambda wl: evict(wl, reason))

    def pend(self, message: str = PENDING_MESSAGE) -> None:
        self._moved(lambda wl: set_condition(wl, "QuotaReserved", "False", "Pending", message))


class Run:
    """Passes over one job in `memory` with Kueue in memory."""

    def __init__(self, memory: Memory, queue: Kueue) -> None:
        self.passes, self.kueue = Pass(memory), queue

    def __call__(self, seconds: float = 0) -> Outcome:
        return self.passes(NOW + timedelta(seconds=seconds), workloads=self.kueue)


def job_cond(memory: Memory, type_: str) -> dict[str, Any]:
    assert memory.job is not None
    return cond(memory.job["status"], type_)


def test_a_job_in_a_queue_gets_its_workload_and_no_pod_until_admitted() -> None:
    memory, queue = Nodes(manifest()), Kueue()
    run = Run(memory, queue)
    assert run().state == "Queued"
    assert memory.pods == {}
    assert memory.service  # the Service and Secret may exist before the admission
    wl = queue.only()
    assert wl["metadata"]["name"] == kueue.workload_name(job())
    assert [(s["name"], s["count"]) for s in wl["spec"]["podSets"]] == [("ps", 1), ("worker", 2)]
    assert job_cond(memory, "Queued")["reason"] == "WorkloadCreated"

    queue.pend()
    assert run().state == "Queued"
    assert memory.pods == {}
    assert (job_cond(memory, "Queued")["reason"], job_cond(memory, "Queued")["message"]) == (
        "Pending",
        PENDING_MESSAGE,
    )
    assert [verb for verb, _ in queue.writes] == ["create"]  # the round trip is no change


def admitted_and_running() -> tuple[Nodes, Kueue, Run]:
    memory, queue = Nodes(manifest()), Kueue()
    run = Run(memory, queue)
    run()
    queue.admit()
    run()
    memory.run_all()
    assert run().state == "Running"
    return memory, queue, run


def test_an_admitted_job_gets_its_pods_on_the_flavor() -> None:
    memory, queue, _ = admitted_and_running()
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]
    for pod in memory.manifests.values():
        assert pod["spec"]["nodeSelector"] == FLAVORS["spot"]["nodeLabels"]
        assert pod["spec"]["tolerations"] == FLAVORS["spot"]["tolerations"]
    assert job_cond(memory, "Admitted")["status"] == "True"
    assert [verb for verb, _ in queue.writes] == ["create"]


def test_an_evicted_job_stops_in_order_then_gives_back_its_reservation_and_resumes() -> None:
    memory, queue, run = admitted_and_running()
    queue.evict()

    assert run(1).state == "Preempted"
    assert sorted(memory.deleted) == ["tj-worker-0", "tj-worker-1"]  # the ps serve on
    assert kueue.condition(queue.only(), "QuotaReserved") is not None
    run(2)  # the workers are still leaving
    assert sorted(memory.deleted) == ["tj-worker-0", "tj-worker-1"]
    memory.gone()
    run(3)
    assert sorted(memory.deleted) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]
    assert kueue.condition(queue.only(), "QuotaReserved") is not None  # the ps is leaving
    run(4)
    assert kueue.condition(queue.only(), "QuotaReserved") is not None
    memory.gone()
    assert run(5).state == "Preempted"
    wl = queue.only()
    assert status_conditions(wl)["QuotaReserved"] == ("False", "Pending")
    assert status_conditions(wl)["Admitted"] == ("False", "NoReservation")
    assert status_conditions(wl)["Requeued"] == ("True", "Preempted")
    assert "admission" not in wl["status"]
    assert memory.pods == {}
    assert job_cond(memory, "Preempted")["status"] == "True"
    run(6)
    assert [verb for verb, _ in queue.writes] == ["create", "status"]  # released once

    queue.admit()
    run(7)
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]
    assert job_cond(memory, "Preempted")["status"] == "False"
    memory.run_all()
    assert run(8).state == "Running"
    assert memory.job is not None
    assert memory.job["status"]["restarts"] == 0


def test_a_succeeded_job_finishes_its_workload_and_drops_the_finalizer() -> None:
    memory, queue, run = admitted_and_running()
    memory.end("tj-worker-0", 0, json.dumps(DONE) + "\n")
    assert run(1).state == "Succeeded"
    wl = queue.only()
    assert status_conditions(wl)["Finished"] == ("True", "Succeeded")
    assert kueue.FINALIZER in wl["metadata"]["finalizers"]
    run(2)
    assert queue.only()["metadata"]["finalizers"] == []
    run(3)
    assert [verb for verb, _ in queue.writes] == ["create", "status", "update"]


def test_a_workload_deleted_under_a_running_job_requeues_it_with_a_new_one() -> None:
    memory, queue, run = admitted_and_running()
    queue.only()["metadata"]["deletionTimestamp"] = "2026-11-23T09:00:00Z"
    assert run(1).state == "Preempted"
    memory.gone()
    run(2)  # the ps
    memory.gone()
    run(3)  # no pod left: the finalizer goes, and with it the Workload
    assert queue.workloads == {}
    run(4)
    assert "deletionTimestamp" not in queue.only()["metadata"]
    queue.admit()
    run(5)
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]


def test_kueue_missing_keeps_the_job_queued_with_its_message_and_no_pod() -> None:
    missing = "Kueue is not installed on this cluster (no workloads.kueue.x-k8s.io CRD)"
    memory, queue = Nodes(manifest()), Kueue(unavailable=missing)
    run = Run(memory, queue)
    assert run().state == "Queued"
    run(1)
    assert memory.pods == {}
    assert job_cond(memory, "Queued")["message"] == missing
    assert queue.workloads == {}


def test_kueue_missing_tries_no_workload_write() -> None:
    memory, queue = Nodes(manifest()), Kueue(unavailable="Kueue is not installed")
    Run(memory, queue)()
    assert queue.refused == []


def test_a_missing_workload_priority_class_keeps_the_job_queued_and_says_which() -> None:
    memory, queue = Nodes(manifest(labels={kueue.PRIORITY_LABEL: "urgent"})), Kueue()
    run = Run(memory, queue)
    assert run().state == "Queued"
    assert memory.pods == {}
    queued = job_cond(memory, "Queued")
    assert queued["reason"] == "NotQueued"
    assert kueue.PRIORITY_LABEL in queued["message"]
    assert "'urgent'" in queued["message"]
    assert "does not exist" in queued["message"]


def test_a_missing_workload_priority_class_creates_no_workload() -> None:
    memory, queue = Nodes(manifest(labels={kueue.PRIORITY_LABEL: "urgent"})), Kueue()
    run = Run(memory, queue)
    run()
    run(1)
    assert queue.workloads == {}
    assert "urgent" in job_cond(memory, "Queued")["message"]


def test_an_existing_workload_priority_class_sets_the_workloads_priority() -> None:
    memory = Nodes(manifest(labels={kueue.PRIORITY_LABEL: "urgent"}))
    queue = Kueue(classes={("WorkloadPriorityClass", "urgent"): 1000})
    Run(memory, queue)()
    spec = queue.only()["spec"]
    assert spec["priority"] == 1000
    assert spec["priorityClassRef"]["name"] == "urgent"


def test_a_deleted_job_releases_its_workloads_finalizer() -> None:
    memory, queue, run = admitted_and_running()
    memory.job = None
    run(1)
    assert all(not wl["metadata"].get("finalizers") for wl in queue.workloads.values())


def test_a_job_not_in_a_queue_runs_without_a_workload() -> None:
    memory, queue = Nodes(manifest(queue=None)), Kueue()
    Run(memory, queue)()
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]
    assert queue.workloads == {}
    assert queue.writes == []


def test_a_job_whose_queue_label_is_removed_runs_without_kueue_and_its_workload_goes() -> None:
    memory, queue, run = admitted_and_running()
    assert memory.job is not None
    del memory.job["metadata"]["labels"][kueue.QUEUE_LABEL]
    run(1)  # deleted: its finalizer holds it
    run(2)  # the finalizer released: gone
    assert queue.workloads == {}  # finalizer released, then deleted: no quota stays held
    assert job_cond(memory, "Admitted")["status"] == "False"
    assert job_cond(memory, "Admitted")["reason"] == "QueueLabelRemoved"
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]  # not stopped


def test_a_suspended_job_deactivates_its_workload_and_resumes_queued_not_preempted() -> None:
    memory, queue, run = admitted_and_running()
    assert memory.job is not None
    memory.job["spec"]["runPolicy"]["suspend"] = True
    memory.job["metadata"]["generation"] = 2
    assert run(1).state == "Suspended"
    assert queue.only()["spec"]["active"] is False  # Kueue evicts it: Deactivated
    assert sorted(memory.deleted) == ["tj-worker-0", "tj-worker-1"]  # the ps last
    queue.evict("Deactivated")
    memory.gone()
    run(2)
    memory.gone()
    run(3)
    wl = queue.only()
    assert status_conditions(wl)["QuotaReserved"] == ("False", "Pending")
    assert status_conditions(wl)["Requeued"] == ("False", "Deactivated")  # parked until resumed
    memory.job["spec"]["runPolicy"]["suspend"] = False
    memory.job["metadata"]["generation"] = 3
    assert run(4).state == "Queued"  # waits for Kueue again: not a preemption
    assert queue.only()["spec"]["active"] is True
    assert memory.pods == {}
    assert not any(  # a suspend is the job's own doing
        c["type"] == "Preempted" and c["status"] == "True"
        for c in memory.job["status"]["conditions"]
    )
    queue.admit()
    run(5)
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]


class OneWorkload:
    """An `Api` answering every GET with `found` (the one Workload of the job's name)."""

    def __init__(self, found: dict[str, Any]) -> None:
        self.found = found

    def call(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        assert method == "GET", (method, path)
        return copy.deepcopy(self.found)


def test_a_workload_of_the_jobs_name_it_does_not_own_fails_it_name_taken_untouched() -> None:
    memory, queue = Nodes(manifest()), Kueue()
    j = copy.deepcopy(memory.job)
    assert j is not None
    name = kueue.workload_name(j)
    someone: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ns", "ownerReferences": [{"uid": "other"}]},
        "spec": {"podSets": [], "queueName": "lq"},
    }
    with pytest.raises(reconcile.NameTakenError, match=f"Workload {name} "):
        kueue_api.KubeWorkloads(OneWorkload(someone)).get(j)  # type: ignore[arg-type]
    ours = {**someone, "metadata": {**someone["metadata"], "ownerReferences": [{"uid": "u-1"}]}}
    assert kueue_api.KubeWorkloads(OneWorkload(ours)).get(j) is not None  # type: ignore[arg-type]

    def taken(job: Mapping[str, Any]) -> dict[str, Any] | None:
        raise reconcile.NameTakenError(f"Workload {name} is not this job's")

    queue.get = taken  # type: ignore[method-assign]
    outcome = Run(memory, queue)()
    assert outcome.state == "Failed"
    failed = job_cond(memory, "Failed")
    assert (failed["reason"], failed["message"]) == (
        "NameTaken",
        f"Workload {name} is not this job's",
    )
    assert queue.writes == []  # never adopted, changed or deleted
    assert memory.pods == {}
