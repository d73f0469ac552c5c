"""Kueue v0.17.0 on the one-node cluster (hack/node.py), built here from its Go module: no registry.

    python3 hack/kueue.py install   [--dir DIR]   build (cached), import the image into the node
                                                 in DIR, install the chart, wait until Kueue
                                                 admits requests
    python3 hack/kueue.py uninstall [--dir DIR]   every Kueue object, the release, its namespace
                                                 and the RBAC below
    python3 hack/kueue.py values                  print the Helm values install uses

What install does, each phase logged with its seconds (research/kueue.md, sections 4 and 6):
1. `hack/control-plane.sh kueue`: the manager binary and the chart from the module (cached).
2. hack/image.py's static image of the binary, localhost/kueue:v0.17.0, imported by the caller's
   `import_image` (node.py's `ctr images import`): the chart's pullPolicy is Never.
3. `helm upgrade --install kueue` into kueue-system, with values sized for a 2-core node:
   requests 100m/256Mi, no leader election (one replica: no stale lease to wait out after a
   crash), only the batch/job integration (so Kueue's Pod, Deployment and StatefulSet webhooks
   stay failurePolicy Ignore and never gate a pod), TrainingJob registered as an external
   framework, internal certificates, the VisibilityOnDemand feature gate off.
4. Deletes the visibility APIServices the chart always creates: this cluster's API server has no
   aggregation layer, and an unavailable APIService breaks discovery and leaves namespaces stuck
   Terminating.
5. The ClusterRole `kueue-jaxps-trainingjobs` (get, list, watch on trainingjobs.jaxps.dev) bound
   to Kueue's ServiceAccount: an external framework's owner lookups are informer reads of it.
6. Waits for the Deployment to be rolled out and Available, then for a server-side dry-run
   create of a ResourceFlavor to pass Kueue's webhooks (failurePolicy Fail: they answer only once
   the internal certificates are written, mounted and injected as caBundles).

Idempotent: running install again upgrades the release in place. Standard library only;
importable by node.py (install, uninstall).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster
import image

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.17.0"
REPOSITORY = "localhost/kueue"
TAG = f"v{VERSION}"
RELEASE = "kueue"
NAMESPACE = "kueue-system"
# Kueue's built-in names for release `kueue` (apis/config/v1beta2/defaults.go; the chart's too)
DEPLOYMENT = SERVICE_ACCOUNT = f"{RELEASE}-controller-manager"
APISERVICES = ("v1beta1.visibility.kueue.x-k8s.io", "v1beta2.visibility.kueue.x-k8s.io")
RBAC_NAME = "kueue-jaxps-trainingjobs"
# The chart's ClusterRoles with an aggregationRule. kube-controller-manager's aggregation
# controller writes their rules by a forced server-side apply (kubernetes#99462), and an apply
# creates what is missing: deleting them while their source roles go too (helm uninstall)
# re-creates them without Helm's labels, which then block the next install.
AGGREGATED_ROLES = (f"{RELEASE}-batch-admin-role", f"{RELEASE}-batch-user-role")
# `Kind.version.group`, matched exactly against a controller ownerReference's apiVersion and kind
EXTERNAL_FRAMEWORKS = ("TrainingJob.v1alpha1.jaxps.dev",)
READY_TIMEOUT = 300.0


def log(message: str) -> None:
    """Progress on stderr, like node.py's."""
    print(f"[kueue] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- what to install


def manager_config() -> dict[str, Any]:
    """The manager's Configuration (config.kueue.x-k8s.io/v1beta2). The chart adds
    internalCertManagement (its webhook Service and Secret) when cert-manager is off."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": ":8081"},
        "metrics": {"bindAddress": ":8443"},
        "webhook": {"port": 9443},
        "leaderElection": {"leaderElect": False},
        "integrations": {
            # no "pod": Kueue's Pod webhook would be failurePolicy Fail in every namespace
            "frameworks": ["batch/job"],
            "externalFrameworks": list(EXTERNAL_FRAMEWORKS),
        },
    }


def helm_values(*, repository: str = REPOSITORY, tag: str = TAG) -> dict[str, Any]:
    """The chart's values (keys of charts/kueue/values.yaml in v0.17.0). JSON is YAML, so this
    dict is written as is; the manager config is a YAML string in the chart, JSON here too."""
    return {
        "enableCertManager": False,
        "enablePrometheus": False,
        "enableVisibilityAPF": False,
        "enableKueueViz": False,
        "controllerManager": {
            "replicas": 1,
            "featureGates": [{"name": "VisibilityOnDemand", "enabled": False}],
            "manager": {
                "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
                "resources": {
                    "requests": {"cpu": "100m", "memory": "256Mi"},
                    "limits": {"cpu": "1", "memory": "512Mi"},
                },
            },
        },
        "managerConfig": {"controllerManagerConfigYaml": json.dumps(manager_config(), indent=2)},
    }


def rbac_manifest() -> dict[str, Any]:
    """Kueue's read access to TrainingJobs (its stock ClusterRole has no jaxps.dev rule)."""
    meta = {"name": RBAC_NAME, "labels": {"app.kubernetes.io/part-of": "jaxps"}}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": meta,
        "rules": [
            {
                "apiGroups": ["jaxps.dev"],
                "resources": ["trainingjobs"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": meta,
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": RBAC_NAME,
        },
        "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}],
    }
    return {"apiVersion": "v1", "kind": "List", "items": [role, binding]}


# A flavor that is never stored: its create passes both ResourceFlavor webhooks or fails
PROBE = {
    "apiVersion": "kueue.x-k8s.io/v1beta2",
    "kind": "ResourceFlavor",
    "metadata": {"name": "jaxps-install-probe"},
}


# ---------------------------------------------------------------------------- running it


class Tools:
    """kubectl and helm against one cluster; every call answers text, never raises on its own
    unless check is set (then with the command's stderr in the message)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.bin = cluster.binaries()

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """kubectl with this cluster's kubeconfig."""
        argv = [str(self.bin / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        return _run(argv, stdin=stdin, check=check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """helm with this cluster's kubeconfig, in Kueue's namespace."""
        argv = [str(self.bin / "helm"), f"--kubeconfig={self.kubeconfig}", "-n", NAMESPACE, *args]
        return _run(argv, check=check)


def _run(
    argv: list[str], *, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, input=stdin, text=True, capture_output=True, check=False)
    if check and done.returncode:
        command = shlex.join([Path(argv[0]).name, *argv[1:]])
        raise SystemExit(f"kueue: `{command}` exited {done.returncode}: {done.stderr.strip()}")
    return done


@contextlib.contextmanager
def _phase(name: str, seconds: dict[str, float]) -> Iterator[None]:
    """Logs a phase and records its seconds under its name."""
    started = time.monotonic()
    yield
    seconds[name] = round(time.monotonic() - started, 1)
    log(f"{name}: {seconds[name]:.1f} s")


def build() -> Path:
    """The manager binary and the chart (hack/control-plane.sh kueue; a finished build is reused):
    the directory holding `manager` and `chart/`."""
    script = str(ROOT / "hack" / "control-plane.sh")
    subprocess.run([script, "kueue"], check=True, stdout=sys.stderr)
    out = subprocess.run([script, "kueue-dir"], check=True, text=True, capture_output=True)
    return Path(out.stdout.strip())


def build_image(kueue_dir: Path) -> Path:
    """The image tarball of the manager, localhost/kueue:v0.17.0 (cached by the binary)."""
    plan = image.make_static_plan(kueue_dir / "manager", ref=f"{REPOSITORY}:{TAG}")
    image.build_static(plan)
    return plan.tar


def install(
    *, state: Path, kubeconfig: Path, import_image: Callable[[Path], None]
) -> dict[str, float]:
    """Kueue running and admitting requests on the cluster of kubeconfig; import_image puts an
    OCI tarball into the node's containerd (k8s.io namespace). Returns each phase's seconds.
    Raises SystemExit naming what did not become ready, with what the cluster says about it."""
    seconds: dict[str, float] = {}
    tools = Tools(kubeconfig)
    started = time.monotonic()
    with _phase("build (cached after the first)", seconds):
        kueue_dir = build()
    with _phase("image", seconds):
        tar = build_image(kueue_dir)
    with _phase("import", seconds):
        import_image(tar)
    with _phase("helm install", seconds):
        values = state / "kueue-values.json"
        values.write_text(json.dumps(helm_values(), indent=2))
        tools.helm(
            "upgrade",
            "--install",
            RELEASE,
            str(kueue_dir / "chart"),
            "--create-namespace",
            # adopts objects left without Helm's labels (AGGREGATED_ROLES after an uninstall)
            "--take-ownership",
            f"--values={values}",
        )
    with _phase("visibility APIServices deleted", seconds):
        tools.kubectl("delete", "apiservice", *APISERVICES, "--ignore-not-found")
    with _phase("RBAC for TrainingJobs", seconds):
        tools.kubectl(
            "apply",
            "--server-side",
            "--field-manager=jaxps",
            "-f",
            "-",
            stdin=json.dumps(rbac_manifest()),
        )
    deadline = time.monotonic() + READY_TIMEOUT
    with _phase("Deployment rolled out and Available", seconds):
        _wait(tools, deadline, f"Deployment {NAMESPACE}/{DEPLOYMENT} Available", _available)
    with _phase("webhooks answer", seconds):
        _wait(tools, deadline, "a dry-run ResourceFlavor create through Kueue's webhooks", _admits)
    seconds["total"] = round(time.monotonic() - started, 1)
    log(f"Kueue v{VERSION} ready in {seconds['total']:.1f} s")
    return seconds


def _available(tools: Tools) -> tuple[bool, str]:
    """Whether the Deployment's current spec is rolled out and Available (after an upgrade that
    changed the pod, the old pod alone must not count); else what its pods are doing."""
    get = ("-n", NAMESPACE, "get", "deployment", DEPLOYMENT, "-o", "json")
    done = tools.kubectl(*get, check=False)
    if done.returncode:
        return False, done.stderr.strip()
    deployment = json.loads(done.stdout)
    status = deployment.get("status", {})
    available = any(
        c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions", [])
    )
    current = status.get("observedGeneration", 0) >= deployment["metadata"]["generation"]
    replicas = deployment["spec"].get("replicas", 1)
    counts = [status.get(key, 0) for key in ("replicas", "updatedReplicas", "availableReplicas")]
    if available and current and counts == [replicas] * 3:
        return True, ""
    return False, _pods(tools)


def _admits(tools: Tools) -> tuple[bool, str]:
    """Whether the API server gets an answer from Kueue's ResourceFlavor webhooks."""
    probe = json.dumps(PROBE)
    done = tools.kubectl("create", "--dry-run=server", "-f", "-", stdin=probe, check=False)
    return done.returncode == 0, done.stderr.strip()


def _pods(tools: Tools) -> str:
    """One line per manager pod: its phase and each container's waiting or last-exit reason."""
    out = tools.kubectl("-n", NAMESPACE, "get", "pods", "-o", "json", check=False).stdout
    lines = []
    for pod in json.loads(out or '{"items": []}')["items"]:
        states = []
        for status in pod.get("status", {}).get("containerStatuses", []):
            for key in ("waiting", "terminated"):
                reason = status.get("state", {}).get(key) or status.get("lastState", {}).get(key)
                if reason:
                    states.append(f"{key} {reason.get('reason')}: {reason.get('message', '')}")
            states.append(f"ready={status.get('ready')} restarts={status.get('restartCount')}")
        phase = pod.get("status", {}).get("phase")
        lines.append(f"pod {pod['metadata']['name']}: {phase}; {'; '.join(states)}")
    return "\n".join(lines) or "no pod yet"


def _wait(
    tools: Tools, deadline: float, what: str, ready: Callable[[Tools], tuple[bool, str]]
) -> None:
    """Polls ready until the deadline; on timeout, SystemExit with what it waited for, the last
    answer and the end of the manager's log."""
    detail = ""
    while time.monotonic() < deadline:
        ok, detail = ready(tools)
        if ok:
            return
        time.sleep(1.0)
    logs = tools.kubectl(
        "-n", NAMESPACE, "logs", f"deployment/{DEPLOYMENT}", "--tail=20", check=False
    )
    raise SystemExit(
        f"kueue: {what}: not ready in {READY_TIMEOUT:.0f} s.\nLast answer: {detail}\n"
        f"Pods: {_pods(tools)}\nThe manager's log ends:\n{logs.stdout or logs.stderr}"
    )


def uninstall(*, kubeconfig: Path) -> None:
    """Every Kueue object first, while the manager still runs: ClusterQueues, ResourceFlavors and
    Workloads carry Kueue's finalizer, and once the release (with the CRDs, which the chart ships
    as templates) is gone nothing would remove it, leaving the CRDs Terminating for good. Then the
    release, its namespace, the visibility APIServices and our RBAC."""
    tools = Tools(kubeconfig)
    started = time.monotonic()
    kinds = tools.kubectl("api-resources", "--api-group=kueue.x-k8s.io", "-o", "name").stdout
    if kinds.split():
        delete = ("delete", ",".join(kinds.split()), "--all", "--all-namespaces")
        tools.kubectl(*delete, "--ignore-not-found", "--timeout=2m")
    # no --wait: it would wait out its timeout on AGGREGATED_ROLES, re-created under it
    tools.helm("uninstall", RELEASE, "--ignore-not-found")
    _delete_aggregated_roles(tools)
    tools.kubectl("delete", "apiservice", *APISERVICES, "--ignore-not-found")
    tools.kubectl("delete", "clusterrolebinding,clusterrole", RBAC_NAME, "--ignore-not-found")
    # waits for the manager's pod and the rest of the namespace to go
    tools.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--timeout=2m")
    log(f"Kueue uninstalled in {time.monotonic() - started:.1f} s")


def _delete_aggregated_roles(tools: Tools, *, tries: int = 10) -> None:
    """Deletes AGGREGATED_ROLES until they stay gone: the aggregation controller may still be
    working through the deletion of their source roles and apply them back once more."""
    for _ in range(tries):
        tools.kubectl("delete", "clusterrole", *AGGREGATED_ROLES, "--ignore-not-found")
        time.sleep(2.0)
        get = ("get", "clusterrole", *AGGREGATED_ROLES, "--ignore-not-found", "-o", "name")
        if not tools.kubectl(*get).stdout.strip():
            return
    log(f"warning: {', '.join(AGGREGATED_ROLES)} keep coming back; the next install adopts them")


def main() -> int:
    """The command line: install, uninstall, values."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("install", "uninstall", "values"))
    parser.add_argument("--dir", type=Path, default=ROOT / ".cluster", help="the node's state")
    args = parser.parse_args()
    state = args.dir.resolve()
    kubeconfig = state / "kubeconfig"
    if args.action == "values":
        print(json.dumps(helm_values(), indent=2))
    elif args.action == "uninstall":
        uninstall(kubeconfig=kubeconfig)
    else:
        sock = state / "containerd.sock"

        def import_image(tar: Path) -> None:
            ctr = ["ctr", "-a", str(sock), "-n", "k8s.io", "images", "import", str(tar)]
            _run(ctr)

        install(state=state, kubeconfig=kubeconfig, import_image=import_image)
    return 0


if __name__ == "__main__":
    sys.exit(main())
