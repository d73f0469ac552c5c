"""A benchmark on the real node, not a test (`make test` does not collect it; run it with
`python bench/admission.py`): seconds from a job's admission by Kueue to every pod Running,
against the same job created without a queue (from its creation), on the same node, in the
order plain, queued, queued, plain, each job's checkpoint claim bound beforehand. One JSON line
per measurement (bench/results), and the runs kept in kueue-admission-to-running.txt.

What it exercises is asserted by tests: a queued job admitted, running and done by
test_kueue.py's `test_two_jobs_against_a_quota_for_one_run_one_after_the_other`, a job without
a queue by every test of test_training.py."""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from functools import partial

import pytest

from jaxps_operator import kueue
from tests.cluster.harness import ROOT, wait_for
from tests.e2e.harness import E2eJobs, keep, phase
from tests.e2e.test_kueue import admitted, queued_job, queues

sys.path.insert(0, str(ROOT / "bench"))
results = importlib.import_module("results")  # bench/results.py: the JSON lines of every bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def all_running(jobs: E2eJobs, name: str, count: int) -> bool:
    pods = jobs.pods(name)
    return len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods.values())


def bound(jobs: E2eJobs, claim: str) -> bool:
    out = jobs.kubectl("get", "pvc", claim, "-o", "jsonpath={.status.phase}", check=False)
    return out.strip() == "Bound"


def test_admission_to_running_with_and_without_kueue(jobs: E2eJobs) -> None:
    with queues(jobs, cpu="4") as q:
        runs = [
            ("without Kueue", queued_job("plain-1", queue="", steps=100)),
            ("with Kueue", queued_job("queued-1", queue=q.local, steps=100)),
            ("with Kueue", queued_job("queued-2", queue=q.local, steps=100)),
            ("without Kueue", queued_job("plain-2", queue="", steps=100)),
        ]
        for _, body in runs:
            claim = f"{body['metadata']['name']}-checkpoints"
            jobs.checkpoint_claim(claim)
            wait_for(partial(bound, jobs, claim), timeout=60, what=f"claim {claim} bound")
        lines = []
        seconds: dict[str, list[float]] = {}
        for label, body in runs:
            name = body["metadata"]["name"]
            if not body["metadata"]["labels"][kueue.QUEUE_LABEL]:
                del body["metadata"]["labels"][kueue.QUEUE_LABEL]
            created = time.monotonic()
            jobs.apply(body)
            since = created
            if label == "with Kueue":
                wait_for(
                    partial(admitted, jobs, name),
                    timeout=120,
                    what=f"{name} admitted",
                    interval=0.05,
                )
                since = time.monotonic()
            wait_for(
                partial(all_running, jobs, name, 2),
                timeout=180,
                what=f"every pod of {name} running",
                interval=0.05,
            )
            running = time.monotonic()
            seconds.setdefault(label, []).append(running - since)
            lines.append(
                f"{name} ({label}): created -> running {running - created:.2f} s, "
                f"admitted -> running {running - since:.2f} s"
            )
            jobs.wait_done(name)
        for line in lines:
            phase(line)
        keep("\n".join(lines), "kueue-admission-to-running.txt")
    results.emit(
        "admission",
        "mlp-2-pods-kueue",
        metric="seconds_admission_to_running",
        value=statistics.mean(seconds["with Kueue"]),
        unit="s",
        baseline="the same job without a queue, creation to running",
        baseline_value=statistics.mean(seconds["without Kueue"]),
        lower_is_better=True,
    )
