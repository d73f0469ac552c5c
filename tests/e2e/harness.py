"""The e2e tier: a real one-node cluster (hack/node.py: the control plane, containerd, the
kubelet, CoreDNS and kube-proxy), both images built here (hack/image.py) and imported into the
node, and the operator installed with the Helm chart, running in-cluster as its Deployment.
Kueue v0.17.0 runs on the node too (hack/kueue.py), with only its batch/job integration: jobs
without a queue label never meet it.

Pods really run the runtime; tests kill real processes on the node. One node per machine:
the tier takes a lock (a second run waits) and always takes the node down, also after a
failure; a run killed outright is cleaned up by the next `up`. Package-scoped: the node stops
when the tier ends. Under pytest-xdist the session's controller brings it up and takes it down
(conftest.py), and every worker attaches to it (`SHARED`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from kubernetes import client, config

from tests import procfs
from tests.cluster.harness import ROOT, Cluster, Jobs, binaries, helm, wait_for

LOCK = Path("/tmp/jaxps-e2e.lock")
RELEASE, RELEASE_NAMESPACE = "jaxps", "jaxps-system"
# How long a TrainingJob may take from apply to Succeeded on a loaded 2-core machine
JOB_TIMEOUT = 420.0


def phase(message: str) -> None:
    """Where the tier's time goes: printed at the end of the run (conftest's terminal summary)
    and written to .work/e2e/phases.log as it happens."""
    line = f"[e2e {time.strftime('%H:%M:%S')}] {message}"
    out = ROOT / ".work" / "e2e"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "phases.log", "a") as log:
        log.write(line + "\n")


@dataclass(frozen=True)
class Image:
    name: str
    ref: str
    tar: Path

    @property
    def repository(self) -> str:
        return self.ref.rsplit(":", 1)[0]

    @property
    def tag(self) -> str:
        return self.ref.rsplit(":", 1)[1]


def _build(argv: list[str], *, what: str, timeout: float) -> str:
    """Runs a build step of the tier; its standard output, or the test fails with its end."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{what} exited {done.returncode}:\n{(done.stderr or done.stdout)[-4000:]}")
    return done.stdout


def build_image(name: str) -> Image:
    started = time.monotonic()
    argv = [sys.executable, str(ROOT / "hack" / "image.py"), "build", name, "--json"]
    out = json.loads(_build(argv, what=f"hack/image.py build {name}", timeout=1800))
    phase(
        f"image {out['ref']}: {'cached' if out['cached'] else 'built'} "
        f"in {time.monotonic() - started:.1f} s"
    )
    return Image(name=name, ref=out["ref"], tar=Path(out["tar"]))


def build_kueue() -> None:
    """Kueue's manager and chart (hack/control-plane.sh kueue: once per machine, then cached),
    built before the node's lock like the images, so node.py's install only reuses them."""
    started = time.monotonic()
    command = [str(ROOT / "hack" / "control-plane.sh"), "kueue"]
    _build(command, what="hack/control-plane.sh kueue", timeout=2400)
    phase(f"Kueue manager and chart: ready in {time.monotonic() - started:.1f} s")


@dataclass
class Node:
    """The running node: where its state is, and how to reach the containers on it."""

    state: Path
    cluster: Cluster
    runtime: Image
    operator: Image

    def ctr(self, *args: str) -> str:
        done = subprocess.run(
            ["ctr", "-a", str(self.state / "containerd.sock"), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return done.stdout

    def container_pid(self, pod: dict[str, Any]) -> int:
        """The host PID of a pod's main container's process."""
        container_id = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
        for line in self.ctr("tasks", "ls").splitlines()[1:]:
            task, pid, *_ = line.split()
            if task == container_id:
                return int(pid)
        pytest.fail(f"no task {container_id} of pod {pod['metadata']['name']} on the node")

    def ps_process(self, pod: dict[str, Any], *, timeout: float = 120) -> int:
        """The host PID of a ps pod's ps process, once its keeper holds a standby beside it
        (`jaxps_runtime.process.keeper`): of its two children, the one it started first (a
        standby is started after the ps it stands by for, and stays one until it takes over)."""
        keeper = self.container_pid(pod)
        return wait_for(
            lambda: procfs.keepers_ps(keeper),
            timeout=timeout,
            what=f"the ps and standby of {pod['metadata']['name']}",
        )

    def kill(self, pod: dict[str, Any]) -> float:
        """SIGKILLs the pod's process on the node, as the OOM killer or a crash would."""
        pid = self.container_pid(pod)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        phase(f"SIGKILLed pid {pid} of pod {pod['metadata']['name']}")
        return killed

    def volume(self, name: str) -> Path:
        """A host directory every pod of a test can share (a hostPath PersistentVolume)."""
        path = self.state / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o1777)  # the runtime image runs as an unprivileged user
        return path


# The state directory of a node the session's controller brought up for its pytest-xdist
# workers (conftest.py): every worker attaches to that one node, with the operator installed.
SHARED = "JAXPS_E2E_NODE"


@contextlib.contextmanager
def node_up() -> Iterator[Node]:
    """Builds both images and Kueue (cached), brings the node up with them imported, and
    always takes it down at the end."""
    if os.geteuid() != 0:
        pytest.fail("the e2e tier runs a kubelet, containerd and a bridge: it needs root")
    runtime, operator = build_image("runtime"), build_image("operator")
    build_kueue()
    with open(LOCK, "w") as lock:
        started = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)  # one node per machine: a second run waits here
        if time.monotonic() - started > 1:
            phase(f"waited {time.monotonic() - started:.0f} s for {LOCK}")
        state = Path(tempfile.mkdtemp(prefix="jaxps-node-", dir="/tmp"))
        hack = [sys.executable, str(ROOT / "hack" / "node.py")]
        try:
            started = time.monotonic()
            subprocess.run(
                [
                    *hack,
                    "up",
                    "--dir",
                    str(state),
                    "--image",
                    str(runtime.tar),
                    "--image",
                    str(operator.tar),
                    "--with-kueue",
                ],
                check=True,
                timeout=600,
            )
            parts = json.loads((state / "phases.json").read_text())
            phase(
                f"node up in {time.monotonic() - started:.1f} s (node {parts['node']:.1f} s, "
                f"Kueue {parts['kueue']:.1f} s)"
            )
            images = {i.name: {"ref": i.ref, "tar": str(i.tar)} for i in (runtime, operator)}
            (state / "images.json").write_text(json.dumps(images))
            yield attach(state)
        finally:
            started = time.monotonic()
            subprocess.run([*hack, "down", "--dir", str(state)], check=False, timeout=300)
            phase(f"node down in {time.monotonic() - started:.1f} s")


@contextlib.contextmanager
def turn(*, exclusive: bool) -> Iterator[None]:
    """Side by side with the other workers' tests, or alone (`exclusive`: it kills or replaces
    what every job shares): a readers-writer lock between the workers, flock on two files of
    the shared node's state. An exclusive holder takes the turnstile, so no test starts while
    it waits for those running to end, then the lock for itself. Nothing without a shared node
    (one process: its tests run one at a time anyway)."""
    state = os.environ.get(SHARED)
    if state is None:
        yield
        return
    with (
        open(Path(state) / "turnstile.lock", "w") as turnstile,
        open(Path(state) / "tests.lock", "w") as tests,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(tests, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(tests, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


def attach(state: Path) -> Node:
    """The node that runs with its state in `state` (brought up by `node_up`)."""
    images = {
        name: Image(name=name, ref=image["ref"], tar=Path(image["tar"]))
        for name, image in json.loads((state / "images.json").read_text()).items()
    }
    kubeconfig = state / "kubeconfig"
    configuration = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=configuration
    )
    return Node(
        state=state,
        cluster=Cluster(kubeconfig=kubeconfig, api_client=client.ApiClient(configuration)),
        runtime=images["runtime"],
        operator=images["operator"],
    )


@pytest.fixture(scope="package")
def node() -> Iterator[Node]:
    shared = os.environ.get(SHARED)
    if shared:  # the controller's, shared by every worker (and taken down by the controller)
        yield attach(Path(shared))
        return
    with node_up() as up:
        yield up


@dataclass
class Installed:
    """The operator as the chart installs it."""

    node: Node

    def pod(self) -> dict[str, Any] | None:
        pods = self.node.cluster.api_client.sanitize_for_serialization(  # type: ignore[no-untyped-call]
            self.node.cluster.core.list_namespaced_pod(
                RELEASE_NAMESPACE, label_selector="app.kubernetes.io/name=jaxps"
            ).items
        )
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return cast(dict[str, Any], live[0]) if len(live) == 1 else None

    def ready_pod(self) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            pod = self.pod()
            statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
            return pod if statuses and statuses[0].get("ready") else None

        return wait_for(ready, timeout=180, what="the operator pod to be ready", interval=0.5)

    def metrics(self) -> str:
        pod = self.ready_pod()
        with urllib.request.urlopen(
            f"http://{pod['status']['podIP']}:8000/metrics", timeout=5
        ) as r:
            return str(r.read().decode())

    def logs(self) -> str:
        return self.node.cluster.kubectl(
            "logs", "-n", RELEASE_NAMESPACE, "deployment/jaxps", "--tail=200", check=False
        )


def install(node: Node) -> None:
    """The operator installed with the chart, running in-cluster as its Deployment."""
    started = time.monotonic()
    helm(
        "install",
        RELEASE,
        str(ROOT / "charts" / "jaxps"),
        f"--kubeconfig={node.cluster.kubeconfig}",
        "--namespace",
        RELEASE_NAMESPACE,
        "--create-namespace",
        "--set",
        f"image.repository={node.operator.repository}",
        "--set",
        f"image.tag={node.operator.tag}",
        "--set",
        f"runtimeImage.repository={node.runtime.repository}",
        "--set",
        f"runtimeImage.tag={node.runtime.tag}",
        "--set",
        "operator.progressInterval=1",
    )
    Installed(node).ready_pod()
    phase(f"chart installed, operator ready in {time.monotonic() - started:.1f} s")


@pytest.fixture(scope="package")
def installed(node: Node) -> Installed:
    if not os.environ.get(SHARED):  # else the controller installed it
        install(node)
    out = Installed(node)
    out.ready_pod()
    return out


@dataclass
class E2eJobs(Jobs):
    """Jobs in one test's namespace, on the real node."""

    node: Node | None = None

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> str:
        return self.cluster.kubectl("-n", self.namespace, *args, check=check, stdin=stdin)

    def checkpoint_claim(self, claim: str) -> Path:
        """A PersistentVolumeClaim bound to a hostPath volume on the node: a shared disk (for
        checkpoints, or data); its directory on the node."""
        assert self.node is not None
        volume = f"{self.namespace}-{claim}"
        path = self.node.volume(volume)
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(path), "type": "Directory"},
                "claimRef": {"namespace": self.namespace, "name": claim},
            },
        }
        pvc = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
        self.kubectl(
            "apply",
            "-f",
            "-",
            stdin=json.dumps({"kind": "List", "apiVersion": "v1", "items": [pv, pvc]}),
        )
        return path

    def wait_done(self, name: str, timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
        """Waits with `kubectl wait` for Succeeded; fails with the status, pods and logs."""
        done = subprocess.run(
            [
                str(binaries() / "kubectl"),
                f"--kubeconfig={self.cluster.kubeconfig}",
                "-n",
                self.namespace,
                "wait",
                "--for=condition=Succeeded",
                f"tj/{name}",
                f"--timeout={int(timeout)}s",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(f"TrainingJob {name} did not succeed: {done.stderr}\n{self.story(name)}")
        return cast(dict[str, Any], self.get(name))

    def story(self, name: str) -> str:
        """What a person would look at when a job went wrong."""
        parts = [
            self.kubectl("get", "tj,pods", "-o", "wide", check=False),
            self.kubectl("describe", "tj", name, check=False),
        ]
        for pod in sorted(self.pods(name)):
            parts.append(f"--- logs of {pod} ---")
            parts.append(self.kubectl("logs", pod, "--tail=30", check=False))
        return "\n".join(parts)

    def wait_progress(self, name: str, key: str, at_least: int, timeout: float = 240) -> int:
        def reached() -> int | None:
            progress = ((self.get(name) or {}).get("status") or {}).get("progress") or {}
            value = int(progress.get(key) or 0)
            return value if value >= at_least else None

        return wait_for(
            reached,
            timeout=timeout,
            what=f"status.progress.{key} >= {at_least} on {name}",
            interval=0.2,
        )

    def pod(self, name: str) -> dict[str, Any]:
        found = self.pods(name.rsplit("-", 2)[0]).get(name)
        if found is None:
            pytest.fail(f"no pod {name}")
        return found

    def running_pod(self, job: str, pod: str) -> dict[str, Any]:
        def running() -> dict[str, Any] | None:
            found = self.pods(job).get(pod)
            if (
                found
                and found["status"].get("phase") == "Running"
                and not found["metadata"].get("deletionTimestamp")
            ):
                statuses = found["status"].get("containerStatuses") or []
                return found if statuses and statuses[0].get("containerID") else None
            return None

        return wait_for(running, timeout=180, what=f"pod {pod} running", interval=0.2)


def manifest(path: Path) -> dict[str, Any]:
    return cast(dict[str, Any], yaml.safe_load(path.read_text()))


@contextlib.contextmanager
def namespace(installed: Installed) -> Iterator[E2eJobs]:
    """A namespace of its own, deleted afterwards with the volumes made for it."""
    cluster_ = installed.node.cluster
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    cluster_.kubectl("create", "namespace", name)
    try:
        yield E2eJobs(cluster_, name, node=installed.node)
    finally:
        cluster_.core.delete_namespace(name)
        for pv in cluster_.core.list_persistent_volume().items:
            volume = str(pv.metadata.name if pv.metadata else "")
            if volume.startswith(f"{name}-"):
                with contextlib.suppress(client.ApiException):
                    cluster_.core.delete_persistent_volume(volume)


@pytest.fixture
def jobs(installed: Installed, request: pytest.FixtureRequest) -> Iterator[E2eJobs]:
    with namespace(installed) as out:
        yield out
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            print(f"--- operator log (tail) ---\n{installed.logs()}")


def chief_step(pod: dict[str, Any]) -> int | None:
    """The task's jaxps_global_step, read from its metrics port on the pod's IP."""
    value = metric(pod, "jaxps_global_step")
    return None if value is None else int(value)


def metric(pod: dict[str, Any], name: str) -> float | None:
    """A metric of the task's (its first sample), read from its metrics port on the pod's IP;
    None while it cannot be read."""
    try:
        with urllib.request.urlopen(
            f"http://{pod['status']['podIP']}:9090/metrics", timeout=1
        ) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{name}{{") or line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def recovered(chief: dict[str, Any], *, recoveries: float, killed: float) -> float:
    """Seconds from `killed` to the chief's first step past its next recovery."""

    def past() -> float | None:
        if (metric(chief, "jaxps_recoveries_total") or 0) <= recoveries:
            return None
        step, to = chief_step(chief), metric(chief, "jaxps_recovered_to_step")
        return time.monotonic() if step is not None and to is not None and step > to else None

    return wait_for(past, timeout=240, what="the step past the recovery", interval=0.01) - killed


def keep(text: str, name: str) -> None:
    """Writes what a test captured for people to read (the closing note) under .work/e2e/."""
    out = ROOT / ".work" / "e2e"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(text)
