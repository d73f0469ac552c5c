"""TrainingJobs under a real Kueue v0.17.0 on the real node (hack/kueue.py installs it).

Each test makes its own ResourceFlavor, ClusterQueue (admitting only its namespace), LocalQueue
and WorkloadPriorityClasses, and removes the cluster-scoped ones afterwards. Every pod of these
jobs requests CPU, so the ClusterQueue's quota decides what runs: a quota that fits one job
makes the second wait with no pod; a higher priority preempts a lower one, which stops (its
chief writing a checkpoint on SIGTERM), gives its quota back and resumes from that checkpoint
once admitted again. What happened is kept, as a timeline, under .work/e2e/.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any, cast

import pytest
from kubernetes.client.exceptions import ApiException

from jaxps_operator import kueue
from tests.cluster.harness import wait_for
from tests.e2e.harness import RELEASE_NAMESPACE, E2eJobs, Installed, keep, phase
from tests.e2e.test_training import start, summary, training_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

KUEUE_NAMESPACE = "kueue-system"
CPU = "250m"  # each pod's request; a job of 1 ps and 1 worker asks 500m
QUOTA_ONE_JOB = "600m"


def queued_job(
    name: str,
    *,
    queue: str,
    steps: int = 400,
    priority: str | None = None,
    every: int = 1000,
) -> dict[str, Any]:
    """A small sync job (1 ps, 1 worker that is the chief) in `queue`, every pod asking CPU."""
    template = {
        "spec": {
            "containers": [
                {"name": "jaxps", "resources": {"requests": {"cpu": CPU, "memory": "256Mi"}}}
            ]
        }
    }
    labels = {kueue.QUEUE_LABEL: queue}
    if priority:
        labels[kueue.PRIORITY_LABEL] = priority
    body = training_job(name, steps=steps)  # test_training's small sync job, checkpointed
    body["metadata"]["labels"] = labels
    body["spec"]["replicaSpecs"] = {
        "ps": {"replicas": 1, "template": template},
        "worker": {"replicas": 1, "template": template},
    }
    body["spec"]["training"]["model"]["kwargs"] = {"hidden": [32]}
    body["spec"]["training"]["checkpoint"]["everySteps"] = every
    return body


class Queues:
    """A ResourceFlavor, ClusterQueue, LocalQueue `lq` and priority classes `<ns>-low` and
    `<ns>-high` for one test's namespace; the cluster-scoped ones are deleted at the end."""

    def __init__(self, jobs: E2eJobs, *, cpu: str) -> None:
        self.jobs = jobs
        ns = jobs.namespace
        self.flavor, self.cluster_queue, self.local = f"{ns}-flavor", f"{ns}-cq", "lq"
        self.low, self.high = f"{ns}-low", f"{ns}-high"
        node = jobs.kubectl("get", "nodes", "-o", "jsonpath={.items[0].metadata.name}")
        self.objects: list[dict[str, Any]] = [
            {
                "apiVersion": kueue.API_VERSION,
                "kind": "ResourceFlavor",
                "metadata": {"name": self.flavor},
                # pods of admitted jobs are placed with this label: it must reach them
                "spec": {"nodeLabels": {"kubernetes.io/hostname": node}},
            },
            {
                "apiVersion": kueue.API_VERSION,
                "kind": "ClusterQueue",
                "metadata": {"name": self.cluster_queue},
                "spec": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                    "preemption": {"withinClusterQueue": "LowerPriority"},
                    "resourceGroups": [
                        {
                            "coveredResources": ["cpu", "memory"],
                            "flavors": [
                                {
                                    "name": self.flavor,
                                    "resources": [
                                        {"name": "cpu", "nominalQuota": cpu},
                                        {"name": "memory", "nominalQuota": "8Gi"},
                                    ],
                                }
                            ],
                        }
                    ],
                },
            },
            {
                "apiVersion": kueue.API_VERSION,
                "kind": "LocalQueue",
                "metadata": {"name": self.local, "namespace": ns},
                "spec": {"clusterQueue": self.cluster_queue},
            },
            {
                "apiVersion": kueue.API_VERSION,
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": self.low},
                "value": 100,
            },
            {
                "apiVersion": kueue.API_VERSION,
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": self.high},
                "value": 1000,
            },
        ]

    def create(self) -> None:
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": self.objects})
        # Kueue's webhooks refuse while it (re)starts: try until they answer
        wait_for(
            lambda: (
                self.jobs.cluster.kubectl("apply", "-f", "-", stdin=body, check=False)
                and self._created()
            ),
            timeout=120,
            what="Kueue's webhooks to accept the queues",
            interval=1.0,
        )

    def _created(self) -> bool:
        out = self.jobs.cluster.kubectl(
            "get", "clusterqueue", self.cluster_queue, "-o", "name", check=False
        )
        return bool(out.strip())

    def delete(self) -> None:
        for kind, name in (
            ("clusterqueue", self.cluster_queue),
            ("resourceflavor", self.flavor),
            ("workloadpriorityclass", self.low),
            ("workloadpriorityclass", self.high),
        ):
            self.jobs.cluster.kubectl(
                "delete", kind, name, "--ignore-not-found", "--wait=false", check=False
            )

    def usage(self) -> dict[str, Any]:
        """The ClusterQueue's status: admitted and reserving workloads, flavors' usage."""
        out = self.jobs.cluster.kubectl(
            "get", "clusterqueue", self.cluster_queue, "-o", "json", check=False
        )
        return dict(json.loads(out).get("status") or {}) if out.strip() else {}


@contextlib.contextmanager
def queues(jobs: E2eJobs, *, cpu: str) -> Iterator[Queues]:
    made = Queues(jobs, cpu=cpu)
    made.create()
    try:
        yield made
    finally:
        made.delete()


class Timeline:
    """What a person watching `kubectl get tj,pods -w` would see, with seconds since start."""

    def __init__(self, jobs: E2eJobs, names: list[str]) -> None:
        self.jobs, self.names = jobs, names
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.seen: dict[str, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def at(self) -> float:
        return time.monotonic() - self.started

    def note(self, text: str) -> None:
        self.lines.append(f"{self.at():7.1f} s  {text}")

    def _run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(ApiException, OSError, ValueError):
                self._look()
            self.stop.wait(0.2)

    def _look(self) -> None:
        for name in self.names:
            job = self.jobs.get(name) or {}
            status = job.get("status") or {}
            true = sorted(
                f"{c['type']}({c['reason']})"
                for c in status.get("conditions") or []
                if c["status"] == "True"
            )
            step = (status.get("progress") or {}).get("step")
            self._changed(f"tj/{name}", f"{status.get('state')} step={step} {' '.join(true)}")
            for pod, body in self.jobs.pods(name).items():
                phase_ = body["status"].get("phase")
                if body["metadata"].get("deletionTimestamp"):
                    phase_ = f"{phase_},Terminating"
                self._changed(f"pod/{pod}", str(phase_))

    def _changed(self, key: str, value: str) -> None:
        # the step alone changes all the time: a line when anything else does
        shown = value.split(" step=", maxsplit=1)[0] + " " + " ".join(value.split(" ")[2:])
        if self.seen.get(key) != shown:
            self.seen[key] = shown
            self.note(f"{key}: {value}")

    def __enter__(self) -> Timeline:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def workload(jobs: E2eJobs, name: str) -> dict[str, Any] | None:
    job = jobs.get(name)
    if job is None:
        return None
    try:
        found = jobs.cluster.custom.get_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, jobs.namespace, "workloads", kueue.workload_name(job)
        )
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return cast(dict[str, Any], found)


def kueue_says(jobs: E2eJobs, name: str, words: str) -> dict[str, Any] | None:
    """The job's Queued condition once its message has `words` in it."""
    queued = jobs.condition(name, "Queued")
    return queued if queued is not None and words in queued["message"] else None


def admitted(jobs: E2eJobs, name: str) -> bool:
    wl = workload(jobs, name)
    return wl is not None and kueue.condition(wl, "Admitted") is not None


def test_two_jobs_against_a_quota_for_one_run_one_after_the_other(jobs: E2eJobs) -> None:
    with queues(jobs, cpu=QUOTA_ONE_JOB) as q:
        first = queued_job("first", queue=q.local)
        second = queued_job("second", queue=q.local)
        with Timeline(jobs, ["first", "second"]) as timeline:
            start(jobs, first)
            wait_for(lambda: admitted(jobs, "first"), timeout=120, what="first admitted")
            start(jobs, second)
            # Kueue's own words, once its scheduler has looked at the Workload
            queued = wait_for(
                partial(kueue_says, jobs, "second", "quota"),
                timeout=60,
                what="second Queued with Kueue's reason",
            )
            timeline.note(f"second Queued: {queued['reason']}: {queued['message']}")
            assert jobs.get("second")["status"]["state"] == "Queued"  # type: ignore[index]
            # while the first runs, the second has no pod at all
            while not jobs.condition("first", "Succeeded"):
                assert jobs.pods("second") == {}, "a pod of the queued job was created"
                time.sleep(0.5)
                assert timeline.at() < 400, "the first job did not finish"
            timeline.note("first Succeeded")
            jobs.wait_done("second")
            timeline.note("second Succeeded")
        keep("\n".join(timeline.lines), "kueue-two-jobs.txt")
        # the finished Workloads gave their quota back
        for name in ("first", "second"):
            wl = workload(jobs, name)
            assert wl is not None
            assert kueue.condition(wl, "Finished") is not None, wl
        wait_for(
            lambda: int(q.usage().get("reservingWorkloads", 1)) == 0,
            timeout=60,
            what="no quota reserved once both finished",
        )
        # the pods ran on the flavor's node label
        worker = jobs.pod("second-worker-0")
        assert "kubernetes.io/hostname" in worker["spec"].get("nodeSelector", {})
        assert worker["metadata"]["labels"][kueue.PODSET_LABEL] == "worker"


LOW_STEPS = 12_000


def test_a_high_priority_job_preempts_a_low_one_which_resumes_from_its_checkpoint(
    jobs: E2eJobs,
) -> None:
    with queues(jobs, cpu=QUOTA_ONE_JOB) as q:
        # long enough that high's admission preempts it before it ends: 3000 steps of this
        # small mlp took ~20 s, and low Succeeded 3 s after high was created (seen on 3 workers)
        low = queued_job("low", queue=q.local, priority=q.low, steps=LOW_STEPS)
        high = queued_job("high", queue=q.local, priority=q.high, steps=300)
        with Timeline(jobs, ["low", "high"]) as timeline:
            start(jobs, low)
            at_preemption = jobs.wait_progress("low", "step", 200, timeout=300)
            timeline.note(f"low at step >= {at_preemption}: creating high")
            start(jobs, high)
            preempted = jobs.wait_condition("low", "Preempted", timeout=120)
            timeline.note(f"low Preempted: {preempted['reason']}: {preempted['message']}")
            wait_for(lambda: not jobs.pods("low"), timeout=120, what="every pod of low gone")
            last = int(
                ((jobs.get("low") or {}).get("status") or {})
                .get("progress", {})
                .get("lastCheckpointStep")
                or 0
            )
            timeline.note(f"low's pods gone; its last checkpoint: step {last}")
            jobs.wait_done("high")
            timeline.note("high Succeeded")
            done = jobs.wait_done("low")
            timeline.note("low Succeeded")
        resumed = summary(jobs, "low-worker-0")["startedFrom"]
        timeline.note(f"low resumed from: {resumed}")
        keep("\n".join(timeline.lines), "kueue-preemption.txt")
        assert preempted["reason"] == "Preempted", preempted
        assert resumed["how"] == "restored", resumed
        # the checkpoint written when it was preempted, not an older one
        assert resumed["step"] >= at_preemption, (resumed, at_preemption)
        assert done["status"]["progress"]["step"] == LOW_STEPS
        assert not jobs.condition("low", "Preempted")
        assert jobs.condition("low", "Admitted")


@pytest.mark.exclusive  # Kueue's manager, which admits every queued job, is killed
def test_kueue_killed_a_workload_deleted_and_a_queued_job_deleted_leave_nothing_behind(
    jobs: E2eJobs, installed: Installed
) -> None:
    with queues(jobs, cpu=QUOTA_ONE_JOB) as q:
        manager = wait_for(
            lambda: next(
                iter(
                    installed.node.cluster.api_client.sanitize_for_serialization(  # type: ignore[no-untyped-call]
                        installed.node.cluster.core.list_namespaced_pod(KUEUE_NAMESPACE).items
                    )
                ),
                None,
            ),
            timeout=30,
            what="Kueue's manager pod",
        )
        # Kueue down while a job arrives: it waits, with no pod, until Kueue admits it
        installed.node.kill(manager)
        start(jobs, queued_job("during", queue=q.local, steps=3000))
        wait_for(
            lambda: admitted(jobs, "during"), timeout=240, what="admitted after Kueue's restart"
        )
        phase("Kueue back: the job that arrived while it was down is admitted")
        jobs.wait_progress("during", "step", 100, timeout=300)
        # its Workload deleted by hand: its pods stop, a new Workload queues it again
        before = workload(jobs, "during")
        assert before is not None
        jobs.cluster.custom.delete_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, jobs.namespace, "workloads", before["metadata"]["name"]
        )
        wait_for(
            lambda: (
                (wl := workload(jobs, "during")) is not None
                and wl["metadata"]["uid"] != before["metadata"]["uid"]
            ),
            timeout=180,
            what="a new Workload for the job whose Workload was deleted",
        )
        jobs.wait_done("during")
        # the operator restarted while a job waits: it still waits, with no pod
        start(jobs, queued_job("blocker", queue=q.local, steps=100000))
        wait_for(lambda: admitted(jobs, "blocker"), timeout=120, what="blocker admitted")
        start(jobs, queued_job("waiting", queue=q.local))
        waiting = wait_for(
            partial(workload, jobs, "waiting"), timeout=60, what="waiting's Workload"
        )
        wait_for(partial(kueue_says, jobs, "waiting", "quota"), timeout=60, what="waiting Queued")
        old = installed.ready_pod()
        installed.node.cluster.kubectl(
            "delete", "pod", "-n", RELEASE_NAMESPACE, old["metadata"]["name"], "--wait=false"
        )
        wait_for(
            lambda: (
                (pod := installed.pod()) is not None
                and pod["metadata"]["uid"] != old["metadata"]["uid"]
            ),
            timeout=120,
            what="a new operator pod",
        )
        installed.ready_pod()
        phase("operator replaced while a job waits in its queue")
        jobs.wait_progress("blocker", "step", 1, timeout=120)
        assert jobs.pods("waiting") == {}
        assert jobs.get("waiting")["status"]["state"] == "Queued"  # type: ignore[index]
        # a job deleted while it waits, and the one that held the quota: nothing stays
        for name in ("waiting", "blocker"):
            jobs.cluster.custom.delete_namespaced_custom_object(
                "jaxps.dev", "v1alpha1", jobs.namespace, "trainingjobs", name
            )
        wait_for(
            lambda: (
                workload_gone(jobs, waiting["metadata"]["name"])
                and not jobs.pods("blocker")
                and int(q.usage().get("reservingWorkloads", 1)) == 0
            ),
            timeout=180,
            what="the deleted jobs' Workloads and pods gone, no quota reserved",
        )


def workload_gone(jobs: E2eJobs, name: str) -> bool:
    try:
        jobs.cluster.custom.get_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, jobs.namespace, "workloads", name
        )
    except ApiException as err:
        return bool(err.status == 404)
    return False


def test_suspend_deactivates_the_workload_and_resume_requeues_it_from_the_checkpoint(
    jobs: E2eJobs,
) -> None:
    with queues(jobs, cpu=QUOTA_ONE_JOB) as q:
        start(jobs, queued_job("paused", queue=q.local, steps=3000))
        at_suspend = jobs.wait_progress("paused", "step", 200, timeout=300)
        jobs.patch_spec("paused", {"runPolicy": {"suspend": True}})
        jobs.wait_condition("paused", "Suspended", timeout=60)
        wait_for(lambda: not jobs.pods("paused"), timeout=120, what="every pod of paused gone")

        def given_back() -> bool:
            wl = workload(jobs, "paused")
            return (
                wl is not None
                and wl["spec"].get("active") is False
                and kueue.condition(wl, "QuotaReserved") is None
                and int(q.usage().get("reservingWorkloads", 1)) == 0
            )

        wait_for(given_back, timeout=60, what="the suspended job's quota given back")
        jobs.patch_spec("paused", {"runPolicy": {"suspend": False}})
        done = jobs.wait_done("paused")
        resumed = summary(jobs, "paused-worker-0")["startedFrom"]
        phase(f"suspended at step >= {at_suspend} under Kueue; resumed from {resumed}")
        assert resumed["how"] == "restored", resumed
        assert resumed["step"] >= at_suspend, (resumed, at_suspend)
        assert done["status"]["progress"]["step"] == 3000
        assert not jobs.condition("paused", "Preempted")  # the job's own suspend
