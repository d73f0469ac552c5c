"""Elastic workers on the real node: `kubectl scale` a sync job 2 -> 4 -> 1 while a ps pod is
SIGKILLed, and every record of the data is still applied exactly once per data epoch.

The job trains the counting model (`tests/process/elastic_user`: each applied visit of a record
adds exactly 1 to that record's own parameter), so the exported parameters are the visit
counts themselves, rollback included. The test also keeps the seconds from `kubectl scale` up
to the new workers' first applied gradient, from `kubectl scale` down to the leaving pods gone,
and the steps per second before and after (`.work/e2e/elastic.txt`).
"""

from __future__ import annotations

import datetime
import functools
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.cluster.harness import ROOT, wait_for
from tests.e2e.harness import E2eJobs, keep, phase

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

USER_CODE = ROOT / "tests" / "process" / "elastic_user"
RECORDS, BATCH, STEPS, EVERY = 640, 16, 2400, 100
FIRST_APPLIED = re.compile(r"^(\S+ \S+) INFO .* its first gradient is applied")


def counting_job(name: str) -> dict[str, Any]:
    user = {
        "spec": {
            "containers": [
                {
                    "name": "jaxps",
                    "env": [{"name": "PYTHONPATH", "value": "/checkpoints/user"}],
                }
            ]
        }
    }
    replicas: dict[str, Any] = {
        "chief": {"replicas": 1, "template": user},
        "ps": {"replicas": 2, "template": user},
        "worker": {"replicas": 2, "maxReplicas": 4, "template": user},
    }
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": replicas,
            "training": {
                "model": {
                    "name": "counting",
                    "module": "counting:make_model",
                    "kwargs": {"records": RECORDS},
                },
                "dataset": {
                    "module": "counting:make_dataset",
                    "kwargs": {"records": RECORDS, "batchSeconds": 0.01},
                },
                "mode": "sync",
                "steps": STEPS,
                "batchSize": BATCH,
                "optimizer": {"name": "sign_sgd", "kwargs": {"learning_rate": 1.0}},
                "checkpoint": {
                    "dir": "/checkpoints",
                    "claimName": f"{name}-checkpoints",
                    "everySteps": EVERY,
                    "keep": 3,
                },
                "exportPath": "/checkpoints/export.npz",
                "heartbeatSeconds": 0.5,
                "logEverySeconds": 1,
            },
        },
    }


def _rate(jobs: E2eJobs, name: str, *, steps: int = 150) -> float:
    """Global steps per second over the next `steps` steps, read from the job's status."""
    first, started = _step(jobs, name), time.monotonic()
    reached = jobs.wait_progress(name, "step", first + steps, timeout=240)
    return (reached - first) / (time.monotonic() - started)


def _first_applied(jobs: E2eJobs, pod: str) -> float | None:
    """The wall-clock time `pod` logged its first applied gradient (None: not yet)."""
    for line in jobs.kubectl("logs", pod, check=False).splitlines():
        found = FIRST_APPLIED.match(line)
        if found:
            stamp = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")
            return stamp.replace(tzinfo=datetime.UTC).timestamp()
    return None


def test_kubectl_scale_up_and_down_with_a_ps_killed_visits_every_record_exactly_once(
    jobs: E2eJobs,
) -> None:
    name = "elastic"
    volume = jobs.checkpoint_claim(f"{name}-checkpoints")
    shutil.copytree(USER_CODE, volume / "user", dirs_exist_ok=True)
    for path in (volume / "user").rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    jobs.apply(counting_job(name))
    try:
        _scale_and_kill(jobs, name, volume)
    except BaseException:
        print(jobs.story(name))
        raise


def _step(jobs: E2eJobs, name: str) -> int:
    progress = ((jobs.get(name) or {}).get("status") or {}).get("progress") or {}
    return int(progress.get("step") or 0)


def _scale_and_kill(jobs: E2eJobs, name: str, volume: Path) -> None:
    node = jobs.node
    assert node is not None
    jobs.wait_progress(name, "step", 300, timeout=300)
    before = _rate(jobs, name)

    scaled_up = time.time()
    jobs.kubectl("scale", f"tj/{name}", "--replicas=4")
    joined: dict[str, float] = {}
    for pod in (f"{name}-worker-2", f"{name}-worker-3"):
        joined[pod] = wait_for(
            functools.partial(_first_applied, jobs, pod),
            timeout=240,
            what=f"{pod}'s first applied gradient",
            interval=0.5,
        )
    join_seconds = {pod: at - scaled_up for pod, at in joined.items()}
    phase(f"scale 2 -> 4: first applied gradients {join_seconds}")
    at_four = _rate(jobs, name)

    jobs.wait_progress(name, "lastCheckpointStep", 2 * EVERY)
    ps = jobs.running_pod(name, f"{name}-ps-0")
    killed_at = _step(jobs, name)
    node.kill(ps)
    wait_for(
        lambda: (
            (p := jobs.pods(name).get(f"{name}-ps-0"))
            and p["metadata"]["uid"] != ps["metadata"]["uid"]
        ),
        timeout=120,
        what="a replacement of the ps pod",
    )
    wait_for(
        lambda: ((jobs.get(name) or {}).get("status") or {}).get("restarts", 0) >= 1,
        timeout=120,
        what="the ps pod's restart counted",
    )
    jobs.wait_progress(name, "step", killed_at + 100, timeout=240)  # rolled back, then past

    scaled_down = time.time()
    jobs.kubectl("scale", f"tj/{name}", "--replicas=1")
    wait_for(
        lambda: not set(jobs.pods(name)) & {f"{name}-worker-{i}" for i in (1, 2, 3)},
        timeout=120,
        what="the leaving workers' pods gone",
        interval=0.2,
    )
    gone_seconds = time.time() - scaled_down
    phase(f"scale 4 -> 1: leaving pods gone after {gone_seconds:.1f} s")
    at_one = _rate(jobs, name)

    job = jobs.wait_done(name)
    status = job["status"]
    assert status["progress"]["step"] == STEPS, status
    counts = np.load(volume / "export.npz")
    [key] = [k for k in counts.files if "count" in k]
    visits = np.rint(counts[key]).astype(np.int64)
    low, high, total = int(visits.min()), int(visits.max()), int(visits.sum())
    line = (
        f"sync, workers 2 -> 4 (at step >= 300) -> ps-0 SIGKILL (step {killed_at}) -> 1; "
        f"{STEPS} steps of {BATCH}, {RECORDS} records: visits min {low} max {high} sum {total}; "
        f"scale up -> first applied gradient {join_seconds}; scale down -> pods gone "
        f"{gone_seconds:.1f} s; steps/s at 2 {before:.1f}, at 4 {at_four:.1f}, at 1 {at_one:.1f}"
    )
    phase(line)
    keep(line + "\n", "elastic.txt")
    assert high - low <= 1, line  # every record applied k or k+1 times: none skipped, none twice
    assert total % BATCH == 0, line  # whole batches only
    events = jobs.kubectl("get", "events", "--field-selector", f"involvedObject.name={name}")
    assert "ScaledUp" in events, events
    assert "ScaledDown" in events, events
