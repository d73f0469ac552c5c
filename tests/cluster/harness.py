"""The cluster tier: a real etcd, kube-apiserver, kube-controller-manager and kube-scheduler
(hack/cluster.py, built by `make control-plane`), the CRD installed with kubectl, and the
operator running as a process (`jaxps operator`). Package-scoped: the control plane stops
when the tier ends, before the process tests run.

There is no kubelet: pods stay unscheduled and the tests move their phases by writing pod
status, as envtest users do. Set JAXPS_TEST_KUBECONFIG to run against a control plane that is
already up (`make cluster-up` writes .cluster/kubeconfig).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "jaxps.dev", "v1alpha1", "trainingjobs"
LABEL_JOB = "jaxps.dev/job-name"
T = TypeVar("T")
# What the runtime's chief leaves in its termination log once training is over
DONE = '{"event": "done", "step": 1}'


def wait_for(
    check: Callable[[], T | None], *, timeout: float = 60.0, what: str, interval: float = 0.1
) -> T:
    """Polls `check` until it returns something truthy; fails naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last seen: {last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binaries() -> Path:
    out = subprocess.run(
        [str(ROOT / "hack" / "control-plane.sh"), "bin"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


@dataclass
class Cluster:
    kubeconfig: Path
    api_client: client.ApiClient
    core: client.CoreV1Api = field(init=False)
    custom: client.CustomObjectsApi = field(init=False)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> str:
        done = subprocess.run(
            [str(binaries() / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            input=stdin,
            check=False,
            timeout=120,
        )
        if check and done.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return done.stdout + done.stderr if not check else done.stdout


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    given = os.environ.get("JAXPS_TEST_KUBECONFIG")
    state = tmp_path_factory.mktemp("control-plane") / "cluster"
    if given:
        kubeconfig = Path(given)
    else:
        if not (binaries() / "kube-apiserver").exists():
            pytest.fail(f"no control plane in {binaries()}: run `make control-plane` first")
        subprocess.run(
            [sys.executable, str(ROOT / "hack" / "cluster.py"), "up", "--dir", str(state)],
            check=True,
            timeout=180,
        )
        kubeconfig = state / "kubeconfig"
    configuration = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), client_configuration=configuration
    )
    try:
        yield Cluster(kubeconfig=kubeconfig, api_client=client.ApiClient(configuration))
    finally:
        if not given:
            subprocess.run(
                [sys.executable, str(ROOT / "hack" / "cluster.py"), "down", "--dir", str(state)],
                check=False,
                timeout=60,
            )


@pytest.fixture(scope="package")
def crd(cluster: Cluster) -> Cluster:
    cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
    # not `kubectl wait --for=condition=Established`: on a CRD whose status the API server has
    # not written yet it fails at once (".status.conditions accessor error: <nil>"), seen
    # when the cluster tier ran beside the e2e tier's start
    established = '{.status.conditions[?(@.type=="Established")].status}'
    wait_for(
        lambda: (
            cluster.kubectl(
                "get", "crd", "trainingjobs.jaxps.dev", "-o", f"jsonpath={established}"
            ).strip()
            == "True"
        ),
        timeout=60,
        interval=0.25,
        what="CRD trainingjobs.jaxps.dev Established",
    )
    return cluster


@dataclass
class Operator:
    """`jaxps operator` as a process, watching every namespace unless `args` say otherwise."""

    kubeconfig: Path
    log: Path
    metrics_port: int = field(default_factory=free_port)
    liveness_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}",
            **self.env,
        }
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxps_operator",
                    "operator",
                    "--progress-interval",
                    "1",
                    "--metrics-port",
                    str(self.metrics_port),
                    "--liveness",
                    f"http://127.0.0.1:{self.liveness_port}/healthz",
                    *self.args,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self.healthy, timeout=60, what=f"the operator's liveness endpoint ({self.log})")

    def healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            pytest.fail(f"the operator exited {self.process.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1
            ) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2
        ) as reply:
            return str(reply.read().decode())

    def stop(self) -> int | None:
        if self.process is None:
            return None
        self.process.terminate()
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.process = None
        return code

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


RELEASE_NAMESPACE = "jaxps-system"


def helm(*args: str) -> str:
    done = subprocess.run(
        [str(binaries() / "helm"), *args], capture_output=True, text=True, check=False, timeout=60
    )
    if done.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done.stdout


def release(*args: str) -> str:
    """The chart rendered as release `jaxps` in RELEASE_NAMESPACE, with helm's `args`."""
    return helm(
        "template", "jaxps", str(ROOT / "charts" / "jaxps"), "--namespace", RELEASE_NAMESPACE, *args
    )


@pytest.fixture(scope="package")
def operator_kubeconfig(crd: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig for the chart's ServiceAccount: the operator runs with the chart's RBAC."""
    crd.kubectl("create", "namespace", RELEASE_NAMESPACE, check=False)  # may exist (reused)
    rendered = release(
        "--show-only",
        "templates/serviceaccount.yaml",
        "--show-only",
        "templates/rbac.yaml",
    )
    crd.kubectl("apply", "-f", "-", stdin=rendered)
    token = crd.kubectl(
        "create", "token", "jaxps", "--namespace", RELEASE_NAMESPACE, "--duration=6h"
    ).strip()
    admin = yaml.safe_load(crd.kubeconfig.read_text())
    admin["users"] = [{"name": "jaxps-operator", "user": {"token": token}}]
    for context in admin["contexts"]:
        context["context"]["user"] = "jaxps-operator"
    path = tmp_path_factory.mktemp("operator-sa") / "kubeconfig"
    path.write_text(json.dumps(admin))
    return path


@pytest.fixture(scope="package")
def operator(
    operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    op = Operator(operator_kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


@dataclass
class Jobs:
    """Helpers on one test's namespace."""

    cluster: Cluster
    namespace: str

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        body = self.cluster.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, manifest
        )
        return cast(dict[str, Any], body)

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            job = self.cluster.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return cast(dict[str, Any], job)

    def patch_spec(self, name: str, patch: dict[str, Any]) -> None:
        self.cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, {"spec": patch}
        )

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        job = self.get(name) or {}
        for c in (job.get("status") or {}).get("conditions", []):
            if c["type"] == type_ and c["status"] == "True":
                return dict(c)
        return None

    def wait_condition(self, name: str, type_: str, timeout: float = 60) -> dict[str, Any]:
        return wait_for(
            lambda: self.condition(name, type_),
            timeout=timeout,
            what=f"condition {type_} on TrainingJob {name}: status "
            f"{json.dumps((self.get(name) or {}).get('status'))}",
        )

    def service_names(self) -> list[str]:
        return sorted(
            s.metadata.name
            for s in self.cluster.core.list_namespaced_service(self.namespace).items
            if s.metadata is not None and s.metadata.name
        )

    def service(self, name: str) -> dict[str, Any] | None:
        try:
            found = self.cluster.core.read_namespaced_service(name, self.namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return cast(
            dict[str, Any],
            self.cluster.api_client.sanitize_for_serialization(found),  # type: ignore[no-untyped-call]
        )

    def pods(self, name: str) -> dict[str, dict[str, Any]]:
        items = self.cluster.api_client.sanitize_for_serialization(  # type: ignore[no-untyped-call]
            self.cluster.core.list_namespaced_pod(
                self.namespace, label_selector=f"{LABEL_JOB}={name}"
            ).items
        )
        return {p["metadata"]["name"]: p for p in items}

    def wait_pods(self, name: str, count: int, timeout: float = 60) -> dict[str, dict[str, Any]]:
        def ready() -> dict[str, dict[str, Any]] | None:
            pods = self.pods(name)
            live = [p for p in pods.values() if not p["metadata"].get("deletionTimestamp")]
            return pods if len(live) == count else None

        return wait_for(ready, timeout=timeout, what=f"{count} pods of {name}")

    def set_phase(
        self,
        pod: str,
        phase: str,
        *,
        exit_code: int | None = None,
        ready: bool = True,
        pod_ip: str | None = None,
        message: str | None = None,
    ) -> None:
        """What a kubelet would write: the phase, the container's state (with its termination
        `message`; by default the final summary for exit 0, as the runtime's chief leaves it),
        the Ready condition."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if phase == "Running":
            state: dict[str, Any] = {"running": {"startedAt": now}}
        elif phase in ("Succeeded", "Failed"):
            code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
            if message is None and (phase, code) == ("Succeeded", 0):
                message = DONE  # a task that trained to the end: the chief's summary
            state = {
                "terminated": {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": now,
                    "finishedAt": now,
                    **({"message": message} if message is not None else {}),
                }
            }
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        running = phase == "Running" and ready
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [
                {"type": "Ready", "status": "True" if running else "False"},
            ],
            "containerStatuses": [
                {
                    "name": "jaxps",
                    "image": "ghcr.io/jaxps/runtime:0.1.0",
                    "imageID": "",
                    "ready": running,
                    "restartCount": 0,
                    "state": state,
                }
            ],
        }
        if pod_ip:
            status["podIP"] = pod_ip
            status["podIPs"] = [{"ip": pod_ip}]
        self.cluster.core.patch_namespaced_pod_status(pod, self.namespace, {"status": status})

    def wait_event(self, name: str, reason: str, contains: str = "") -> list[dict[str, Any]]:
        """The Events of `reason` on TrainingJob `name`, once one says `contains`."""

        def seen() -> list[dict[str, Any]] | None:
            found = [e for e in self.events(name) if e["reason"] == reason]
            return found if any(contains in (e["message"] or "") for e in found) else None

        return wait_for(seen, what=f"a {reason} Event on {name} saying {contains!r}")

    def events(self, name: str) -> list[dict[str, Any]]:
        items = self.cluster.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}"
        ).items
        return [
            {"reason": e.reason, "type": e.type, "message": e.message}
            for e in sorted(items, key=lambda e: str(e.metadata.creation_timestamp))
        ]


@pytest.fixture
def jobs(operator: Operator, request: pytest.FixtureRequest) -> Iterator[Jobs]:
    cluster_ = request.getfixturevalue("crd")
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    cluster_.core.create_namespace({"metadata": {"name": namespace}})
    try:
        yield Jobs(cluster_, namespace)
    finally:
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(f"--- operator log (tail) ---\n{operator.tail()}")
        cluster_.core.delete_namespace(namespace)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
