"""A benchmark on the real node, not a test (`make test` does not collect it; run it with
`python bench/recovery.py --kubernetes`): a ps pod's ps process SIGKILLed, to the job's next
step past the recovery, several times; baseline, in the same run: the pod's whole container
killed, which Kubernetes answers with a new pod (scheduling, sandbox, container, imports).

The job is the e2e tier's mlp (2 ps + 2 workers, worker 0 the chief, sync, a checkpoint every
200 steps). Each kill waits for ps-0's keeper to hold a standby (`process.keeper`), then for a
step halfway between two checkpoints, then SIGKILLs the ps process (the keeper's child that is
no standby); the recovery is over when the chief's `jaxps_recoveries_total` has moved and its
global step is past `jaxps_recovered_to_step`. One JSON line per measurement (bench/results).
"""

from __future__ import annotations

import importlib
import os
import signal
import statistics
import sys
import time
from typing import Any

import pytest

from tests.cluster.harness import ROOT, wait_for
from tests.e2e.harness import E2eJobs, chief_step, metric, phase, recovered
from tests.e2e.test_training import EVERY, start, training_job

sys.path.insert(0, str(ROOT / "bench"))
results = importlib.import_module("results")  # bench/results.py: the JSON lines of every bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
KILLS = int(os.environ.get("JAXPS_BENCH_KILLS", "5"))
BASELINE_KILLS = int(os.environ.get("JAXPS_BENCH_BASELINE_KILLS", "2"))


def midway(chief: dict[str, Any]) -> None:
    """Waits for a step halfway between two checkpoints (a kill there loses steps to see)."""
    now = chief_step(chief) or 0
    target = (now // EVERY + 1) * EVERY + EVERY // 2
    wait_for(lambda: (chief_step(chief) or 0) >= target, timeout=240, what=f"step {target}")


def test_recovery_of_a_killed_ps_process_on_the_node(jobs: E2eJobs) -> None:
    node = jobs.node
    assert node is not None
    name = start(jobs, training_job("recovery", steps=1_000_000))
    jobs.wait_progress(name, "lastCheckpointStep", EVERY)
    chief = jobs.running_pod(name, f"{name}-worker-0")
    in_pod, new_pod = [], []
    for _ in range(KILLS):
        ps = node.ps_process(jobs.running_pod(name, f"{name}-ps-0"))
        midway(chief)
        before = metric(chief, "jaxps_recoveries_total") or 0
        os.kill(ps, signal.SIGKILL)
        in_pod.append(recovered(chief, recoveries=before, killed=time.monotonic()))
        phase(f"ps process killed: next step {in_pod[-1]:.2f} s later")
    for _ in range(BASELINE_KILLS):
        midway(chief)
        before = metric(chief, "jaxps_recoveries_total") or 0
        killed = node.kill(jobs.running_pod(name, f"{name}-ps-0"))  # the keeper: a new pod
        new_pod.append(recovered(chief, recoveries=before, killed=killed))
        phase(f"ps container killed (a new pod): next step {new_pod[-1]:.2f} s later")
    jobs.kubectl("delete", "tj", name, "--wait=false")
    baseline = statistics.median(new_pod)
    case = "mlp-2ps-2w-sync-kill-ps0-process-node"
    values = {
        "median": statistics.median(in_pod),
        "max": max(in_pod),
        **{str(i): value for i, value in enumerate(in_pod)},
    }
    for label, value in values.items():
        results.emit(
            "recovery",
            f"{case}-{label}",
            metric="seconds_to_next_step",
            value=value,
            unit="s",
            baseline="a new pod (the container killed)",
            baseline_value=baseline,
            lower_is_better=True,
        )
