"""The operator's speed against a real control plane: one JSON object per measurement.

    python bench/operator.py [--jobs 1 20] [--flips 10]

Starts its own control plane (hack/cluster.py, built by `make control-plane`), installs the CRD
and runs `jaxps operator` as a process. Two timed measurements, each with a baseline measured in the
same run on the same control plane: Kubernetes' own Job controller (kube-controller-manager),
the controller every Kubernetes user already runs.

- create-N: from applying N TrainingJobs (1 chief + 2 ps + 4 workers = 7 pods each) to all
  7N pods existing. Baseline: N batch/v1 Jobs with parallelism 7 until their 7N pods exist.
- phase-to-status: from a pod's status turning Running and ready (written as a kubelet
  would) to the owner's status counting it (TrainingJob `status.readyReplicas`; Job
  `status.ready`). Median over --flips pods.

`ratio` = baseline / jaxps: above 1, the operator is faster than the Job controller.
Last, `usage`: the operator's resident memory (now and its peak) and CPU seconds for the whole
run, with every job of the run still live (no comparable baseline here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import results
from kubernetes import client, config

ROOT = Path(__file__).resolve().parent.parent
GROUP, VERSION, PLURAL = "jaxps.dev", "v1alpha1", "trainingjobs"
POLL = 0.02
TIMEOUT = 180.0


def wait(check: Callable[[], bool], what: str) -> float:
    """Seconds until `check()` holds (polled every 20 ms)."""
    started = time.perf_counter()
    while not check():
        if time.perf_counter() - started > TIMEOUT:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(POLL)
    return time.perf_counter() - started


def training_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {
                "chief": {"replicas": 1},
                "ps": {"replicas": 2},
                "worker": {"replicas": 4},
            },
            "training": {"steps": 100},
        },
    }


def batch_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "parallelism": 7,
            "completions": 7,
            "template": {
                "metadata": {"labels": {"bench": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "busybox"}],
                },
            },
        },
    }


class Bench:
    def __init__(self, kubeconfig: Path) -> None:
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.batch = client.BatchV1Api(api)
        self.kubeconfig = kubeconfig

    def namespace(self, name: str) -> str:
        self.core.create_namespace({"metadata": {"name": name}})
        return name

    def pod_count(self, namespace: str) -> int:
        pods = json.loads(self.core.list_namespaced_pod(namespace, _preload_content=False).data)
        return len(pods["items"])

    def running(self, namespace: str, pod: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.core.patch_namespaced_pod_status(
            pod,
            namespace,
            {
                "status": {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "containerStatuses": [
                        {
                            "name": "x",
                            "image": "x",
                            "imageID": "",
                            "ready": True,
                            "restartCount": 0,
                            "state": {"running": {"startedAt": now}},
                        }
                    ],
                }
            },
        )

    # --- create-N ---------------------------------------------------------------------------

    def create_jaxps(self, count: int, run: int) -> float:
        ns = self.namespace(f"tj-{count}-{run}")
        started = time.perf_counter()
        for i in range(count):
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, training_job(f"job-{i}")
            )
        wait(lambda: self.pod_count(ns) >= 7 * count, f"{7 * count} TrainingJob pods")
        return time.perf_counter() - started

    def create_batch(self, count: int, run: int) -> float:
        ns = self.namespace(f"job-{count}-{run}")
        started = time.perf_counter()
        for i in range(count):
            self.batch.create_namespaced_job(ns, batch_job(f"job-{i}"))
        wait(lambda: self.pod_count(ns) >= 7 * count, f"{7 * count} Job pods")
        return time.perf_counter() - started

    def live_jobs(self) -> list[Any]:
        """Every TrainingJob there is now."""
        listed = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
        return list(listed["items"])

    # --- phase-to-status --------------------------------------------------------------------

    def flips_jaxps(self, flips: int) -> list[float]:
        ns = self.namespace("tj-flips")
        self.custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, training_job("flips")
        )

        def ready() -> int:
            job = self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "flips")
            text = (job.get("status") or {}).get("readyReplicas", "0/7")
            return int(str(text).split("/")[0])

        return self.flips(ns, ready, flips)

    def flips_batch(self, flips: int) -> list[float]:
        ns = self.namespace("job-flips")
        self.batch.create_namespaced_job(ns, batch_job("flips"))

        def ready() -> int:
            status = self.batch.read_namespaced_job_status("flips", ns).status
            return int((status.ready if status else 0) or 0)

        return self.flips(ns, ready, flips)

    def flips(self, ns: str, ready: Callable[[], int], flips: int) -> list[float]:
        """Turns pods Running one at a time; the seconds until `ready()` counts each."""
        wait(lambda: self.pod_count(ns) >= 7, "7 pods")
        pods = sorted(
            p.metadata.name for p in self.core.list_namespaced_pod(ns).items if p.metadata
        )
        times = []
        for pod in pods[:flips]:
            before = ready()
            self.running(ns, pod)
            started = time.perf_counter()
            wait(lambda b=before: ready() > b, f"the owner counting {pod}")  # type: ignore[misc]
            times.append(time.perf_counter() - started)
        return times


def usage(pid: int, *, jobs: int) -> None:
    """The operator's resident memory (now and its peak) and CPU seconds so far, with `jobs`
    TrainingJobs live: what it costs to run, which no baseline here is comparable to (the
    Job controller shares its process with every other controller)."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    for metric, value, unit in (
        (f"resident memory with {jobs} live jobs", int(status["VmRSS"].split()[0]) / 1024, "MB"),
        (f"peak resident memory, {jobs} live jobs", int(status["VmHWM"].split()[0]) / 1024, "MB"),
        (f"CPU seconds for the whole run, {jobs} live jobs", cpu, "s"),
    ):
        results.emit("operator", "usage", metric=metric, value=value, unit=unit)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--flips", type=int, default=7, help="pods flipped to Running (<= 7)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each create case")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxps-bench-operator-") as tmp:
        state = Path(tmp) / "cluster"
        subprocess.run(
            [sys.executable, str(ROOT / "hack" / "cluster.py"), "up", "--dir", str(state)],
            check=True,
            stdout=sys.stderr,
        )
        operator: subprocess.Popen[bytes] | None = None
        try:
            kubeconfig = state / "kubeconfig"
            kubectl = (
                Path(
                    subprocess.run(
                        [str(ROOT / "hack" / "control-plane.sh"), "bin"],
                        capture_output=True,
                        text=True,
                        check=True,
                    ).stdout.strip()
                )
                / "kubectl"
            )
            for argv in (
                ["apply", "-f", str(ROOT / "crds" / "trainingjob.yaml")],
                ["wait", "--for=condition=Established", "crd/trainingjobs.jaxps.dev"],
            ):
                subprocess.run(
                    [str(kubectl), "--kubeconfig", str(kubeconfig), *argv],
                    check=True,
                    stdout=sys.stderr,
                )
            liveness = 18080 + os.getpid() % 1000
            with open(Path(tmp) / "operator.log", "wb") as log:
                operator = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "jaxps_operator",
                        "operator",
                        "--metrics-port",
                        "0",
                        "--liveness",
                        f"http://127.0.0.1:{liveness}/healthz",
                    ],
                    env={
                        **os.environ,
                        "KUBECONFIG": str(kubeconfig),
                        "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}",
                    },
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

            def alive() -> bool:
                try:
                    with urllib.request.urlopen(
                        f"http://127.0.0.1:{liveness}/healthz", timeout=1
                    ) as reply:
                        return bool(reply.status == 200)
                except OSError:
                    return False

            wait(alive, "the operator")
            bench = Bench(kubeconfig)
            for count in args.jobs:
                ours, theirs = [], []
                for run in range(args.repeats):  # alternating, so drift hits both alike
                    ours.append(bench.create_jaxps(count, run))
                    theirs.append(bench.create_batch(count, run))
                results.emit(
                    "operator",
                    f"create-{count}",
                    metric=f"seconds until all {7 * count} pods exist (median of {args.repeats})",
                    value=statistics.median(ours),
                    unit="s",
                    baseline="kube-controller-manager Job controller",
                    baseline_value=statistics.median(theirs),
                    lower_is_better=True,
                )
            ours = bench.flips_jaxps(args.flips)
            theirs = bench.flips_batch(args.flips)
            results.emit(
                "operator",
                "phase-to-status",
                metric=f"seconds from a pod turning Running to the owner's status (median of "
                f"{args.flips})",
                value=statistics.median(ours),
                unit="s",
                baseline="kube-controller-manager Job controller",
                baseline_value=statistics.median(theirs),
                lower_is_better=True,
            )
            usage(operator.pid, jobs=len(bench.live_jobs()))
        finally:
            if operator is not None:
                operator.terminate()
                operator.wait(timeout=30)
            subprocess.run(
                [sys.executable, str(ROOT / "hack" / "cluster.py"), "down", "--dir", str(state)],
                check=False,
                stdout=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
