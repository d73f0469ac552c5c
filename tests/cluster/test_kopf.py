"""The operator on kopf and the official client: credentials from an `exec` plugin (as EKS,
GKE and AKS hand them out), for the operator and the SDK; and kopf writes nothing to any
object the operator watches (no annotation, no finalizer: the pass is the only writer)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from jaxps.sdk import Client
from tests.cluster.harness import Jobs, Operator, wait_for
from tests.cluster.test_operator import mnist, run_all


def passes(op: Operator) -> int:
    """The operator's reconcile passes so far (its own Prometheus histogram)."""
    found = re.search(r"^jaxps_operator_reconcile_seconds_count (\S+)$", op.metrics(), re.M)
    return int(float(found.group(1))) if found else 0


def exec_kubeconfig(operator_kubeconfig: Path, folder: Path) -> tuple[Path, Path]:
    """The operator's kubeconfig with its user's token handed out by an exec credential
    plugin (a script printing an ExecCredential), and the file the plugin counts its runs in."""
    config = yaml.safe_load(operator_kubeconfig.read_text())
    (user,) = config["users"]
    token = user["user"]["token"]
    runs = folder / "plugin-runs"
    plugin = folder / "credential-plugin"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": token},
    }
    plugin.write_text(f"#!/bin/sh\necho run >> {runs}\necho '{json.dumps(credential)}'\n")
    plugin.chmod(0o755)
    user["user"] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(plugin),
            "interactiveMode": "Never",
        }
    }
    path = folder / "exec-kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path, runs


def test_the_operator_and_the_sdk_run_with_an_exec_plugin_kubeconfig(
    operator_kubeconfig: Path, jobs: Jobs, tmp_path: Path
) -> None:
    kubeconfig, runs = exec_kubeconfig(operator_kubeconfig, tmp_path)
    op = Operator(
        kubeconfig, tmp_path / "exec-operator.log", args=(f"--namespace={jobs.namespace}",)
    )
    op.start()
    try:
        jobs.apply(mnist("exec"))
        wait_for(lambda: passes(op) > 0, timeout=30, what=f"a pass of the operator:\n{op.tail()}")
        jobs.wait_pods("exec", 4)
        assert "Traceback" not in op.tail(20_000), op.tail()
    finally:
        assert op.stop() == 0, op.tail()
    assert runs.read_text().count("run") >= 1  # the plugin gave the credentials

    before = runs.read_text().count("run")
    sdk = Client.kubernetes(kubeconfig=kubeconfig, namespace=jobs.namespace)
    (job,) = [j for j in sdk.list() if j.name == "exec"]
    assert job.name == "exec"
    assert runs.read_text().count("run") > before  # the SDK ran it too


def kopf_marks(obj: dict[str, Any]) -> list[str]:
    meta = obj.get("metadata") or {}
    found = [k for k in meta.get("annotations") or {} if "kopf" in k]
    return found + [f for f in meta.get("finalizers") or [] if "kopf" in f]


def test_kopf_writes_no_annotation_or_finalizer_on_any_object_the_operator_watches(
    jobs: Jobs,
) -> None:
    jobs.apply(mnist("marks"))
    run_all(jobs, "marks")
    jobs.wait_condition("marks", "Running")
    kinds = "trainingjobs,pods,services,secrets,networkpolicies,events"
    listed = json.loads(jobs.cluster.kubectl("get", kinds, "-n", jobs.namespace, "-o", "json"))
    objects = listed["items"]
    assert {o["kind"] for o in objects} >= {"TrainingJob", "Pod", "Service", "Secret"}
    marked = {f"{o['kind']}/{o['metadata']['name']}": kopf_marks(o) for o in objects}
    assert {k: v for k, v in marked.items() if v} == {}
