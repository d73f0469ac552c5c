"""The Helm chart: lints, renders, and what it renders is accepted by the API server.

(Every cluster test also runs the operator with the chart's ServiceAccount and RBAC: see the
`operator_kubeconfig` fixture.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.cluster.harness import ROOT, Cluster, helm

CHART = ROOT / "charts" / "jaxps"


def kinds(rendered: str) -> list[tuple[str, str]]:
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    return [(d["kind"], d["metadata"].get("namespace", "")) for d in docs]


def test_the_chart_lints_and_carries_the_crd_unchanged() -> None:
    helm("lint", "--strict", str(CHART))
    assert (CHART / "crds" / "trainingjob.yaml").read_text() == (
        ROOT / "crds" / "trainingjob.yaml"
    ).read_text()


def test_the_default_render_is_accepted_by_the_apiserver(crd: Cluster) -> None:
    rendered = helm("template", "jaxps", str(CHART), "--namespace", "default", "--include-crds")
    assert sorted(kinds(rendered)) == sorted(
        [
            ("CustomResourceDefinition", ""),
            ("ServiceAccount", "default"),
            ("ClusterRole", ""),
            ("ClusterRoleBinding", ""),
            ("ClusterRole", ""),
            ("ClusterRoleBinding", ""),
            ("Deployment", "default"),
        ]
    )
    crd.kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered)
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "operator"
    assert not any(a.startswith("--namespace") for a in container["args"])
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # ready once the jobs are listed; the Lease's identity from the pod's name
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["env"][0]["name"] == "POD_ID"
    assert "--runtime-image=ghcr.io/jaxps/runtime:0.1.0" in container["args"]


def test_watched_namespaces_get_roles_and_replicas_get_a_lease(crd: Cluster) -> None:
    rendered = helm(
        "template",
        "jaxps",
        str(CHART),
        "--namespace",
        "ops",
        "--set",
        "replicas=2",
        "--set",
        "watchNamespaces={team-a,team-b}",
    )
    found = kinds(rendered)
    assert ("Role", "team-a") in found
    assert ("RoleBinding", "team-b") in found
    assert ("Role", "ops") in found
    assert ("RoleBinding", "ops") in found
    assert not any(kind == "CustomResourceDefinition" for kind, _ in found)
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args
    assert "--peering=jaxps" in args
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_ID": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    # the namespaced objects (roles) are valid for the apiserver too
    roles = "\n---\n".join(
        yaml.safe_dump(d)
        for d in yaml.safe_load_all(rendered)
        if d and d["kind"] in ("ClusterRole", "ClusterRoleBinding")
    )
    crd.kubectl("apply", "--dry-run=server", "-f", "-", stdin=roles)


def test_the_operator_does_not_load_jax_numpy_or_grpc() -> None:
    """What lets the operator image go without them."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, jaxps_operator.cli, jaxps_operator.controller; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'jax', 'jaxlib', 'numpy', 'grpc', 'optax'}))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'operator'}", "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "[]"
    assert Path(ROOT / "docker" / "operator.Dockerfile").read_text().count("'.[operator]'") == 1


def test_the_grafana_dashboard_renders_the_charts_json_when_enabled(crd: Cluster) -> None:
    rendered = helm(
        "template",
        "jaxps",
        str(CHART),
        "--namespace",
        "default",
        "--set",
        "grafana.dashboard.enabled=true",
        "--set",
        "grafana.dashboard.namespace=monitoring",
    )
    configmap = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap")
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["jaxps.json"]) == json.loads(
        (CHART / "dashboards" / "jaxps.json").read_text()
    )
    crd.kubectl("create", "namespace", "monitoring", check=False)
    crd.kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(configmap))
