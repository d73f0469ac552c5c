"""What one status write of a job costs the API server: a TrainingJob's, as the jaxps operator
writes it, against a TFJob's, as Kubeflow's training-operator v1.9.3 writes it.

    python bench/status_write.py [--writes 600] [--rounds 12]

A pod's phase reaches its job's status through one status write (the PUT of the `status`
subresource), which is most of `bench/operator.py`'s phase-to-status on this machine: the API
server decodes the body, validates the whole job against its CRD (schema and CEL rules),
keeps the field bookkeeping (`managedFields`), and stores it. What a job holds, and what a
write sends, sets that cost. This bench starts its own control plane (hack/cluster.py), with
the TrainingJob CRD and Kubeflow's TFJob CRD (`hack/control-plane.sh kubeflow` builds it once),
and writes each job's status in turns, `--writes / --rounds` writes a round:

- jaxps: a TrainingJob of 1 chief + 2 ps + 4 workers, its status as `planner.plan` makes it
  with all 7 pods running and ready, written by `kube.KubeCluster.replace_job_status` (what
  the operator sends), `readyReplicas` alternating between 6/7 and 7/7.
- Kubeflow: a TFJob of the same tasks, with the status training-operator v1.9.3 writes for it
  (two conditions, an active count per replica type, startTime, as read back from a run of
  `bench/operator.py`), the whole object PUT, as its client's UpdateStatus does; a worker
  count alternating between 3 and 4.

Printed: the median and p90 time of a write, and kube-apiserver's CPU per write (its
/proc/PID/stat over the writes). `ratio` = Kubeflow / jaxps: above 1, jaxps costs less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubeflow
import results
import yaml
from proc import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "runtime")]

from jaxps_operator import builders, kube, kubeclient, planner, schema  # noqa: E402
from jaxps_operator.objects import PodState  # noqa: E402

ROLES = {"chief": 1, "ps": 2, "worker": 4}
BASELINE = "TFJob status as training-operator v1.9.3 writes it"
NAMESPACE = "bench-status"


def training_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": kube.API,
        "kind": kube.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicaSpecs": {role: {"replicas": n} for role, n in ROLES.items()},
            "training": {"steps": 100},
        },
    }


def tf_job(name: str) -> dict[str, Any]:
    template = {"spec": {"containers": [{"name": "tensorflow", "image": "busybox"}]}}
    return kubeflow.tf_job(name, roles=ROLES, template=template, namespace=NAMESPACE)


def tf_status(workers: int) -> dict[str, Any]:
    """What training-operator v1.9.3 wrote for a running TFJob in `bench/operator.py`."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def condition(type_: str, reason: str, message: str) -> dict[str, str]:
        return {
            "type": type_,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastUpdateTime": now,
            "lastTransitionTime": now,
        }

    return {
        "conditions": [
            condition("Created", "TFJobCreated", "TFJob tf is created."),
            condition("Running", "TFJobRunning", f"TFJob {NAMESPACE}/tf is running."),
        ],
        "replicaStatuses": {
            "Chief": {"active": 1},
            "PS": {"active": 2},
            "Worker": {"active": workers},
        },
        "startTime": now,
    }


def jaxps_status(job: dict[str, Any]) -> dict[str, Any]:
    """The status the operator's pass makes for `job` with every pod running and ready."""
    valid = schema.validate(job)
    pods = [
        PodState(builders.pod_name(valid, role, i), role, i, "Running", ready=True)
        for role, n in builders.replicas(valid).items()
        for i in range(n)
    ]
    now = datetime.now(UTC)
    network = builders.dns_network(valid)
    first = planner.plan(valid, pods[:-1], now, network=network).status  # 6 of 7 ready
    status: dict[str, Any] = planner.plan(
        {**valid, "status": first}, pods, now, network=network
    ).status
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=600, help="status writes of each job")
    parser.add_argument("--rounds", type=int, default=12, help="turns the two jobs take")
    args = parser.parse_args()
    subprocess.run(
        [str(ROOT / "hack" / "control-plane.sh"), "kubeflow"], check=True, stdout=sys.stderr
    )
    kubeflow_dir = kubeflow.control_plane("kubeflow-dir")
    with tempfile.TemporaryDirectory(prefix="jaxps-bench-status-") as name, ExitStack() as stack:
        state = Path(name) / "cluster"
        cluster = [sys.executable, str(ROOT / "hack" / "cluster.py")]
        subprocess.run([*cluster, "up", "--dir", str(state)], check=True, stdout=sys.stderr)
        stack.callback(
            subprocess.run, [*cluster, "down", "--dir", str(state)], check=False, stdout=sys.stderr
        )
        os.environ["KUBECONFIG"] = str(state / "kubeconfig")
        api = kubeclient.Api()
        for crd in (ROOT / "crds" / "trainingjob.yaml", Path(kubeflow_dir) / "tfjobs.yaml"):
            body = yaml.safe_load(crd.read_text())
            api.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=body)
        deadline = time.monotonic() + 120
        while True:  # until both CRDs serve
            try:
                api.call("GET", f"/apis/{kube.API}/namespaces/default/{kube.PLURAL}")
                api.call("GET", "/apis/kubeflow.org/v1/namespaces/default/tfjobs")
                break
            except kubeclient.ApiError:
                if time.monotonic() > deadline:
                    raise SystemExit("the CRDs were not served within 120 s") from None
                time.sleep(0.2)
        api.call("POST", "/api/v1/namespaces", body={"metadata": {"name": NAMESPACE}})
        found = subprocess.run(
            ["pgrep", "-n", "kube-apiserver"], capture_output=True, text=True, check=True
        )
        server = int(found.stdout.split()[0])
        ours = kube.KubeCluster(api)
        tj = api.call(
            "POST", kube.namespaced(NAMESPACE, kube.PLURAL, group=kube.API), body=training_job("tj")
        )
        ready = jaxps_status(tj)
        statuses = [{**ready, "readyReplicas": "6/7"}, ready]
        tf_path = f"/apis/kubeflow.org/v1/namespaces/{NAMESPACE}/tfjobs"
        tf = api.call("POST", tf_path, body=tf_job("tf"))
        times: dict[str, list[float]] = {"jaxps": [], "kubeflow": []}
        cpu = {"jaxps": 0.0, "kubeflow": 0.0}
        per_round = max(args.writes // args.rounds, 1)
        for round_ in range(args.rounds):
            for party in ("jaxps", "kubeflow") if round_ % 2 == 0 else ("kubeflow", "jaxps"):
                before = cpu_seconds(server)
                for i in range(per_round):
                    started = time.perf_counter()
                    if party == "jaxps":
                        current = ours.get_job(NAMESPACE, "tj")
                        assert current is not None
                        ours.replace_job_status({**current, "status": statuses[i % 2]})
                    else:
                        tf["status"] = tf_status(3 + i % 2)
                        tf = api.call("PUT", f"{tf_path}/tf/status", body=tf)
                    times[party].append(time.perf_counter() - started)
                cpu[party] += cpu_seconds(server) - before
        stored = {
            "jaxps": len(
                str(api.call("GET", kube.namespaced(NAMESPACE, kube.PLURAL, "tj", group=kube.API)))
            ),
            "kubeflow": len(str(api.call("GET", f"{tf_path}/tf"))),
        }
        print(f"stored objects, characters: {stored}", file=sys.stderr)
    writes = {party: len(t) for party, t in times.items()}
    for statistic, pick in (
        ("median", statistics.median),
        ("p90", lambda t: sorted(t)[int(0.9 * len(t))]),
    ):
        results.emit(
            "status-write",
            f"put-{statistic}",
            metric=f"seconds of one status write ({statistic} of {writes['jaxps']})",
            value=pick(times["jaxps"]),
            unit="s",
            baseline=BASELINE,
            baseline_value=pick(times["kubeflow"]),
            lower_is_better=True,
        )
    results.emit(
        "status-write",
        "apiserver-cpu",
        metric="kube-apiserver CPU seconds per status write",
        value=cpu["jaxps"] / writes["jaxps"],
        unit="s",
        baseline=BASELINE,
        baseline_value=cpu["kubeflow"] / writes["kubeflow"],
        lower_is_better=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
