"""The operator's speed against a real control plane: one JSON object per measurement.

    python bench/operator.py [--baseline kubeflow] [--jobs 1 100] [--flips 41] [--py-spy PATH]

Starts its own control plane (hack/cluster.py, built by `make control-plane`), installs the CRD
and runs `jaxps operator` as a process. Every case is measured for each party in the same run
on the same control plane, taking turns, each party in its own namespace, which its operator
alone watches (so no operator holds another's pods):

- jaxps: `jaxps operator --namespace bench-jaxps`, TrainingJobs of 1 chief + 2 ps + 4 workers.
- Kubernetes' own Job controller (kube-controller-manager), the controller every Kubernetes user
  already runs: batch/v1 Jobs with parallelism 7.
- With `--baseline kubeflow`: Kubeflow's training-operator v1.9.3, the TFJob controller (built
  once by `hack/control-plane.sh kubeflow`), TFJobs of the same 1 chief + 2 ps + 4 workers, run
  twice side by side: as shipped (its client held to 20 requests a second) and with its client
  unthrottled (`--kube-api-qps 1000`), which is the bar.

Cases:
- create-N: from applying N jobs to all 7N pods existing (median of --repeats for N = 1).
- phase-to-status: from a pod's status turning Running and ready (written as a kubelet would)
  to the owner's status counting it (TrainingJob `status.readyReplicas`; Job `status.ready`;
  TFJob `status.replicaStatuses.*.active`). Median and p99 over --flips pods of --flips / 7
  jobs, the parties taking turns pod by pod.
- usage: each operator's resident memory (now and its peak) and CPU seconds for the whole run,
  with every job of the run still live (not for the Job controller, which shares its process
  with every other controller).

`ratio` = baseline / jaxps: above 1, jaxps does better.

With `--py-spy PATH` (py-spy is no dependency: `pip install --target DIR py-spy`) the jaxps
operator is sampled for the whole run (without pausing it) and where its CPU went is printed
on stderr: its share per library and per module of ours, and the functions that used most.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubeflow
import results
from kubernetes import client, config

ROOT = Path(__file__).resolve().parent.parent
GROUP, VERSION, PLURAL = "jaxps.dev", "v1alpha1", "trainingjobs"
KUBEFLOW = "training-operator v1.9.3"
RUN_LABEL = "bench-run"
ROLES = {"chief": 1, "ps": 2, "worker": 4}
PODS = sum(ROLES.values())
POLL = 0.02
FLIP_POLL = 0.001
"""A flip's owner is read again 1 ms after each answer: at 20 ms a flip's time was mostly where
it fell between two reads (both operators answer in under 20 ms), not the operator's."""
TIMEOUT = 600.0


def wait(check: Callable[[], bool], what: str, *, poll: float = POLL) -> float:
    """Seconds until `check()` holds (polled every `poll` seconds)."""
    started = time.perf_counter()
    while not check():
        if time.perf_counter() - started > TIMEOUT:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(poll)
    return time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def template(run: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": {RUN_LABEL: run}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "tensorflow", "image": "busybox"}],
        },
    }


def training_job(name: str, run: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {
                role: {"replicas": n, "template": {"metadata": template(run)["metadata"]}}
                for role, n in ROLES.items()
            },
            "training": {"steps": 100},
        },
    }


def tf_job(name: str, run: str) -> dict[str, Any]:
    return kubeflow.tf_job(name, roles=ROLES, template=template(run))


def batch_job(name: str, run: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"parallelism": PODS, "completions": PODS, "template": template(run)},
    }


class PodCounter:
    """Counts the pods created in a namespace by their run label, from one watch (no list
    polled while hundreds of pods are made: that would load the API server being measured)."""

    def __init__(self, core: client.CoreV1Api, namespace: str) -> None:
        self.core, self.namespace = core, namespace
        self.counts: Counter[str] = Counter()
        self.seen: set[str] = set()
        threading.Thread(target=self._watch, daemon=True, name=f"pods-{namespace}").start()

    def _watch(self) -> None:
        with contextlib.suppress(Exception):  # the control plane stopped: the run is over
            self._follow()

    def _follow(self) -> None:
        version = ""
        while True:
            stream = self.core.list_namespaced_pod(
                self.namespace,
                label_selector=RUN_LABEL,
                watch=True,
                resource_version=version,
                allow_watch_bookmarks=True,
                _preload_content=False,
            )
            for line in stream:
                event = json.loads(line)
                meta = event["object"].get("metadata", {})
                version = meta.get("resourceVersion", version)
                if event["type"] == "ADDED" and meta["name"] not in self.seen:
                    self.seen.add(meta["name"])
                    self.counts[meta["labels"][RUN_LABEL]] += 1

    def __getitem__(self, run: str) -> int:
        return self.counts[run]


@dataclass
class Party:
    """One controller under test: how its jobs are made and how its status counts pods."""

    name: str
    namespace: str
    make: Callable[[str, str], dict[str, Any]]  # (name, run) -> manifest
    create: Callable[[str, dict[str, Any]], Any]  # (namespace, manifest)
    counted: Callable[[str], int]  # job name -> pods its status counts as running
    pid: int | None = None  # the operator's process, for `usage`
    pods: PodCounter | None = None
    jobs: int = 0

    def apply(self, name: str, run: str) -> None:
        self.create(self.namespace, self.make(name, run))
        self.jobs += 1


@dataclass
class Bench:
    kubeconfig: Path
    core: client.CoreV1Api = field(init=False)
    custom: client.CustomObjectsApi = field(init=False)
    batch: client.BatchV1Api = field(init=False)

    def __post_init__(self) -> None:
        configuration = client.Configuration()
        config.load_kube_config(
            config_file=str(self.kubeconfig), client_configuration=configuration
        )
        api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.batch = client.BatchV1Api(api)

    def established(self) -> bool:
        crds = client.ApiextensionsV1Api(self.core.api_client).list_custom_resource_definition()
        return all(
            any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])
            for crd in crds.items
        )

    def namespace(self, name: str) -> str:
        self.core.create_namespace({"metadata": {"name": name}})
        return name

    # --- the parties ----------------------------------------------------------------------

    def jaxps(self, namespace: str, pid: int) -> Party:
        def counted(name: str) -> int:
            job = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            return int(str((job.get("status") or {}).get("readyReplicas", "0/7")).split("/")[0])

        return Party(
            "jaxps",
            namespace,
            training_job,
            lambda ns, body: self.custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, body
            ),
            counted,
            pid,
        )

    def job_controller(self, namespace: str) -> Party:
        def counted(name: str) -> int:
            status = self.batch.read_namespaced_job_status(name, namespace).status
            return int((status.ready if status else 0) or 0)

        return Party(
            "kube-controller-manager Job controller",
            namespace,
            batch_job,
            self.batch.create_namespaced_job,
            counted,
        )

    def kubeflow(self, name: str, namespace: str, pid: int) -> Party:
        def counted(job: str) -> int:
            body = self.custom.get_namespaced_custom_object(
                "kubeflow.org", "v1", namespace, "tfjobs", job
            )
            replicas = (body.get("status") or {}).get("replicaStatuses") or {}
            return sum(int(r.get("active") or 0) for r in replicas.values())

        return Party(
            name,
            namespace,
            tf_job,
            lambda ns, body: self.custom.create_namespaced_custom_object(
                "kubeflow.org", "v1", ns, "tfjobs", body
            ),
            counted,
            pid,
        )

    # --- the cases --------------------------------------------------------------------------

    def create(self, party: Party, count: int, run: str) -> float:
        """Seconds from applying `count` jobs to all their pods existing."""
        assert party.pods is not None
        pods = party.pods
        started = time.perf_counter()
        for i in range(count):
            party.apply(f"{run}-{i}", run)
        wait(lambda: pods[run] >= PODS * count, f"{PODS * count} pods of {party.name}")
        return time.perf_counter() - started

    def flip_pods(self, party: Party, flips: int) -> list[tuple[str, str]]:
        """Applies the jobs whose pods will be flipped, waits for their pods: (run, pod) each."""
        assert party.pods is not None
        pods = party.pods
        chosen: list[tuple[str, str]] = []
        for number in range((flips + PODS - 1) // PODS):
            run = f"flips-{number}"
            party.apply(run, run)
            wait(lambda r=run: pods[r] >= PODS, f"the pods of {party.name}'s {run}")  # type: ignore[misc]
            names = sorted(
                p.metadata.name
                for p in self.core.list_namespaced_pod(
                    party.namespace, label_selector=f"{RUN_LABEL}={run}"
                ).items
                if p.metadata
            )
            chosen += [(run, pod) for pod in names[: flips - len(chosen)]]
        return chosen

    def flip(self, party: Party, run: str, pod: str) -> float:
        """Turns one pod Running; the seconds until the owner's status counts it."""
        before = party.counted(run)
        self.running(party.namespace, pod)
        started = time.perf_counter()
        wait(
            lambda: party.counted(run) > before,
            f"{party.name} counting {pod}",
            poll=FLIP_POLL,
        )
        return time.perf_counter() - started

    def flips(self, parties: list[Party], flips: int) -> dict[str, list[float]]:
        """`flips` pods of each party turned Running one at a time, the parties taking turns
        flip by flip (so what the API server is still doing after the creates, or a slow
        moment of the machine, falls on every party alike); every party's jobs are made
        first. The seconds until each owner's status counted each pod, per party."""
        chosen = {p.name: self.flip_pods(p, flips) for p in parties}
        times: dict[str, list[float]] = {p.name: [] for p in parties}
        for number in range(flips):
            turn = number % len(parties)
            for party in parties[turn:] + parties[:turn]:
                times[party.name].append(self.flip(party, *chosen[party.name][number]))
        return times

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
                            "name": "tensorflow",
                            "image": "busybox",
                            "imageID": "",
                            "ready": True,
                            "restartCount": 0,
                            "state": {"running": {"startedAt": now}},
                        }
                    ],
                }
            },
        )


def usage(pid: int) -> tuple[float, float, float]:
    """A process's resident memory and its peak (MB), and its CPU seconds so far."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return (
        int(status["VmRSS"].split()[0]) / 1024,
        int(status["VmHWM"].split()[0]) / 1024,
        cpu,
    )


# Where a sampled frame's time goes, by the file of the innermost frame (first match wins).
PLACES = (
    ("kopf", "kopf"),
    ("aiohttp", "aiohttp"),
    ("kubernetes/", "kubernetes client"),
    ("urllib3", "urllib3"),
    ("cryptography", "cryptography (certificates)"),
    ("celpy", "celpy and lark (CEL rules)"),
    ("lark", "celpy and lark (CEL rules)"),
    ("selectors.py", "waiting (select)"),
    ("/json/", "json"),
    ("ssl.py", "ssl and sockets"),
    ("socket.py", "ssl and sockets"),
    ("http/client.py", "http.client"),
    ("jaxps_operator/", "jaxps_operator"),
    ("prometheus_client", "prometheus_client"),
    ("asyncio/", "asyncio"),
    ("threading.py", "threads"),
    ("concurrent/", "threads"),
    ("queue.py", "threads"),
    ("logging/", "logging"),
)


def place(frame: str) -> str:
    """`func (path:line)` -> what it belongs to; our modules by name."""
    path = frame[frame.rfind("(") + 1 :]
    for needle, name in PLACES:
        if needle in path:
            if name == "jaxps_operator":
                return "jaxps_operator." + path.split("jaxps_operator/")[1].split(".py")[0]
            return name
    return "other"


def profile_summary(raw: Path, top: int = 12) -> str:
    """py-spy's raw (collapsed) stacks: the share of samples per place and per function."""
    places: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # the innermost frame of a place named (typing's or functools' go to their caller)
        leaf = next((f for f in reversed(frames) if place(f) != "other"), frames[-1])
        places[place(leaf)] += int(count)
        functions[leaf.split(" (")[0] + " " + place(leaf)] += int(count)
        total += int(count)
    if not total:
        return "no samples"
    lines = [f"{total} samples (100 a second, of the thread holding the GIL), by place:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in places.most_common(top)]
    lines.append("by function:")
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in functions.most_common(top)]
    return "\n".join(lines)


def p99(times: list[float]) -> float:
    return statistics.quantiles(times, n=100, method="inclusive")[98]


def serving_certs(stack: ExitStack) -> None:
    """The webhook certificate files Kubeflow's operator reads at start, at the path it has
    built in (its rotator only checks they exist; its webhooks are not registered here): a
    self-signed pair, the runtime's own, removed when the run ends if the run made it."""
    sys.path.insert(0, str(ROOT / "runtime"))
    from jaxps_runtime.wire import credentials

    top = Path("/tmp/k8s-webhook-server")
    where = top / "serving-certs"
    if (where / "tls.crt").exists() and (where / "tls.key").exists():
        return
    if not top.exists():
        stack.callback(shutil.rmtree, top, ignore_errors=True)
    where.mkdir(parents=True, exist_ok=True)
    pair = credentials.authority("bench")
    (where / "tls.key").write_bytes(pair.key)
    (where / "tls.crt").write_bytes(pair.cert)


def ready(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    return check


@contextmanager
def process(
    argv: list[str], env: dict[str, str], log: Path, *, stop: int = signal.SIGTERM
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(stop)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


tool = kubeflow.control_plane


def start_jaxps(stack: ExitStack, kubeconfig: Path, tmp: Path, namespace: str) -> int:
    liveness = free_port()
    proc = stack.enter_context(
        process(
            [
                sys.executable,
                "-m",
                "jaxps_operator",
                "operator",
                "--namespace",
                namespace,
                "--metrics-port",
                "0",
                "--liveness",
                f"http://127.0.0.1:{liveness}/healthz",
            ],
            {
                **os.environ,
                "KUBECONFIG": str(kubeconfig),
                "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}",
            },
            tmp / "jaxps-operator.log",
        )
    )
    wait(ready(f"http://127.0.0.1:{liveness}/healthz"), "the jaxps operator")
    return proc.pid


def start_kubeflow(
    stack: ExitStack, bench: Bench, kubeconfig: Path, tmp: Path, namespace: str, *, qps: int | None
) -> int:
    """Kubeflow's operator watching `namespace` only; `qps`: its client's limit (None: as
    shipped, 20 a second)."""
    # its certificate rotator fills this Secret (in the namespace it watches: it reads
    # through its cache) and starts the controllers once it has
    bench.core.create_namespaced_secret(
        namespace, {"metadata": {"name": "training-operator-webhook-cert"}}
    )
    probe = free_port()
    proc = stack.enter_context(
        process(
            [
                str(Path(tool("kubeflow-dir")) / "training-operator"),
                "--enable-scheme=tfjob",
                f"--namespace={namespace}",
                "--metrics-bind-address=0",
                f"--health-probe-bind-address=127.0.0.1:{probe}",
                f"--webhook-server-port={free_port()}",
                *([f"--kube-api-qps={qps}"] if qps else []),
            ],
            {**os.environ, "KUBECONFIG": str(kubeconfig), "MY_POD_NAMESPACE": namespace},
            tmp / f"kubeflow-{namespace}.log",
        )
    )
    wait(ready(f"http://127.0.0.1:{probe}/readyz"), f"Kubeflow's operator in {namespace}")
    return proc.pid


def measure(bench: Bench, parties: list[Party], args: argparse.Namespace) -> None:
    ours, baselines = parties[0], parties[1:]
    for count in args.jobs:
        repeats = args.repeats if count < 10 else 1
        times: dict[str, list[float]] = {p.name: [] for p in parties}
        for run in range(repeats):  # taking turns, so drift hits every party alike
            turn = run % len(parties)
            for party in parties[turn:] + parties[:turn]:
                times[party.name].append(bench.create(party, count, f"c{count}-r{run}"))
        for party in baselines:
            results.emit(
                "operator",
                f"create-{count}",
                metric=f"seconds until all {PODS * count} pods exist (median of {repeats})",
                value=statistics.median(times[ours.name]),
                unit="s",
                baseline=party.name,
                baseline_value=statistics.median(times[party.name]),
                lower_is_better=True,
            )
    flips = bench.flips(parties, args.flips)
    for name, times in flips.items():  # the whole distribution, for whoever reads the tail
        ms = ", ".join(f"{1000 * t:.0f}" for t in times)
        print(f"phase-to-status of {name}, ms in order: {ms}", file=sys.stderr)
    for party in baselines:
        for statistic, of in (("median", statistics.median), ("p99", p99)):
            results.emit(
                "operator",
                f"phase-to-status-{statistic}",
                metric=f"seconds from a pod turning Running to the owner's status "
                f"({statistic} of {args.flips})",
                value=of(flips[ours.name]),
                unit="s",
                baseline=party.name,
                baseline_value=of(flips[party.name]),
                lower_is_better=True,
            )
    assert ours.pid is not None
    mine = usage(ours.pid)
    metrics = (
        f"resident memory, {ours.jobs} live jobs",
        f"peak resident memory, {ours.jobs} live jobs",
        f"CPU seconds for the whole run, {ours.jobs} live jobs",
    )
    units = ("MB", "MB", "s")
    theirs = [(p.name, usage(p.pid)) for p in baselines if p.pid is not None]
    for i, (metric, unit) in enumerate(zip(metrics, units, strict=True)):
        if not theirs:  # the Job controller shares its process: nothing to compare with
            results.emit("operator", "usage", metric=metric, value=mine[i], unit=unit)
        for name, figures in theirs:
            results.emit(
                "operator",
                "usage",
                metric=metric,
                value=mine[i],
                unit=unit,
                baseline=name,
                baseline_value=figures[i],
                lower_is_better=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline",
        choices=("job-controller", "kubeflow"),
        default="job-controller",
        help="kubeflow: Kubeflow's training-operator too (built once; needs Go)",
    )
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--flips", type=int, default=41, help="pods flipped to Running")
    parser.add_argument("--repeats", type=int, default=5, help="runs of create-N for N < 10")
    parser.add_argument("--py-spy", help="the py-spy executable: profile the jaxps operator")
    args = parser.parse_args()
    kubeflow = args.baseline == "kubeflow"
    if kubeflow:
        subprocess.run(
            [str(ROOT / "hack" / "control-plane.sh"), "kubeflow"], check=True, stdout=sys.stderr
        )
    with tempfile.TemporaryDirectory(prefix="jaxps-bench-operator-") as name, ExitStack() as stack:
        if kubeflow:
            serving_certs(stack)
        tmp = Path(name)
        state = tmp / "cluster"
        cluster = [sys.executable, str(ROOT / "hack" / "cluster.py")]
        subprocess.run([*cluster, "up", "--dir", str(state)], check=True, stdout=sys.stderr)
        stack.callback(
            subprocess.run, [*cluster, "down", "--dir", str(state)], check=False, stdout=sys.stderr
        )
        kubeconfig = state / "kubeconfig"
        kubectl = [str(Path(tool("bin")) / "kubectl"), "--kubeconfig", str(kubeconfig)]
        crds = [ROOT / "crds" / "trainingjob.yaml"]
        if kubeflow:
            crds.append(Path(tool("kubeflow-dir")) / "tfjobs.yaml")
        for crd in crds:  # create, not apply: TFJob's CRD is too big for apply's annotation
            subprocess.run([*kubectl, "create", "-f", str(crd)], check=True, stdout=sys.stderr)
        bench = Bench(kubeconfig)
        wait(bench.established, "the CRDs to be established")
        ns = bench.namespace("bench-jaxps")
        ours = start_jaxps(stack, kubeconfig, tmp, ns)
        if args.py_spy:
            raw = tmp / "jaxps-operator.raw"
            spy = stack.enter_context(
                process(
                    [
                        args.py_spy,
                        "record",
                        "--pid",
                        str(ours),
                        "--rate",
                        "100",
                        "--nonblocking",
                        "--gil",
                        "--format",
                        "raw",
                        "--output",
                        str(raw),
                    ],
                    dict(os.environ),
                    tmp / "py-spy.log",
                    stop=signal.SIGINT,  # py-spy writes its file on SIGINT
                )
            )
        parties = [
            bench.jaxps(ns, ours),
            bench.job_controller(bench.namespace("bench-job")),
        ]
        if kubeflow:
            for namespace, qps, label in (
                ("bench-kubeflow", None, "as shipped, 20 requests/s"),
                ("bench-kubeflow-fast", 1000, "client unthrottled"),
            ):
                bench.namespace(namespace)
                pid = start_kubeflow(stack, bench, kubeconfig, tmp, namespace, qps=qps)
                parties.append(bench.kubeflow(f"{KUBEFLOW} ({label})", namespace, pid))
        for party in parties:
            party.pods = PodCounter(bench.core, party.namespace)
        measure(bench, parties, args)
        if args.py_spy:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
            print(f"where the jaxps operator's CPU went:\n{profile_summary(raw)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
