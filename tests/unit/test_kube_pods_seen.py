"""The pods a pass reads (kopf's index of the pod watch, with what the operator did since),
kept slim; the credentials the official client loads for the operator and the SDK; and when a
job's Secret, NetworkPolicy and Service are read again."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any

import pytest

from jaxps_operator import kube, kubeclient


def pod(name: str, version: str, *, job: str = "tj", phase: str = "Pending") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": version,
            "labels": {
                "jaxps.dev/job-name": job,
                "jaxps.dev/replica-type": "worker",
                "jaxps.dev/replica-index": name.rsplit("-", 1)[-1],
            },
            "ownerReferences": [{"uid": "job-uid", "kind": "TrainingJob", "name": job}],
            "creationTimestamp": "2026-11-21T12:00:00Z",
            "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}] * 20,
            "annotations": {"big": "x" * 1000},
        },
        "spec": {
            "containers": [
                {
                    "name": "jaxps",
                    "image": "runtime",
                    "env": [{"name": "TF_CONFIG", "value": "x" * 2000}],
                    "ports": [{"name": "metrics", "containerPort": 9191}],
                    "resources": {"limits": {"memory": "1Gi"}},
                }
            ],
            "volumes": [{"name": "credentials"}],
        },
        "status": {
            "phase": phase,
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "jaxps", "state": {"running": {}}}],
        },
    }


class Index:
    """What kopf's index of pods hands a pass: the job's pods as the watch has them, slimmed
    (a dict here: kopf's own index is exercised by the cluster tier)."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}

    def __call__(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return list(self.pods.get((namespace, job), {}).values())

    def event(self, cluster: kube.KubeCluster, type_: str, pod: dict[str, Any]) -> None:
        """A watch event as kopf handles it: the index first, then the on.event handler."""
        meta = pod["metadata"]
        pods = self.pods.setdefault((meta["namespace"], meta["labels"]["jaxps.dev/job-name"]), {})
        if type_ == "DELETED":
            pods.pop(meta["name"], None)
        else:
            pods[meta["name"]] = kube.slim_pod(pod)
        cluster.pod_event(type_, pod)


def watched() -> tuple[kube.KubeCluster, Index]:
    index = Index()
    return kube.KubeCluster(network_policies=False, pod_index=index), index


def names(cluster: kube.KubeCluster, job: str = "tj") -> dict[str, str]:
    return {p["metadata"]["name"]: p["status"].get("phase", "") for p in cluster.pods("ns", job)}


def test_a_slim_pod_reads_as_the_whole_pod_and_is_a_fraction_of_its_size() -> None:
    whole = pod("tj-worker-1", "10", phase="Running")
    slim = kube.slim_pod(whole)
    assert kube.pod_state(slim, "job-uid") == kube.pod_state(whole, "job-uid")
    assert len(repr(slim)) * 5 < len(repr(whole))


def test_a_pod_the_operator_created_is_read_before_its_watch_event_then_as_watched() -> None:
    cluster, index = watched()
    cluster._created("ns", pod("tj-worker-0", "10"))
    assert names(cluster) == {"tj-worker-0": "Pending"}  # no event yet: as the create answered
    index.event(cluster, "ADDED", pod("tj-worker-0", "10"))
    index.event(cluster, "MODIFIED", pod("tj-worker-0", "12", phase="Running"))
    assert names(cluster) == {"tj-worker-0": "Running"}
    assert cluster._made == {}  # forgotten once the watch spoke of it


def test_a_created_pod_the_watch_showed_first_is_read_as_watched_and_forgotten() -> None:
    cluster, index = watched()
    index.event(cluster, "ADDED", pod("tj-worker-0", "10"))  # before the create's answer
    cluster._created("ns", pod("tj-worker-0", "10"))
    assert names(cluster) == {"tj-worker-0": "Pending"}
    assert cluster._made == {}  # the index has it: nothing kept until its next event


def test_a_created_pod_whose_deletion_the_watch_saw_first_is_not_brought_back() -> None:
    cluster, index = watched()
    index.event(cluster, "ADDED", pod("tj-worker-0", "10"))
    index.event(cluster, "DELETED", pod("tj-worker-0", "15"))
    cluster._created("ns", pod("tj-worker-0", "10"))  # the create's answer, late
    assert names(cluster) == {}
    cluster._created("ns", pod("tj-worker-0", "20"))  # the replacement, same name
    assert names(cluster) == {"tj-worker-0": "Pending"}


def test_pods_are_read_per_job_and_a_pod_without_the_job_label_is_ignored() -> None:
    cluster, index = watched()
    index.event(cluster, "ADDED", pod("tj-worker-0", "10"))
    index.event(cluster, "ADDED", pod("other-worker-0", "11", job="other"))
    stray = pod("stray-0", "12")
    del stray["metadata"]["labels"]["jaxps.dev/job-name"]
    cluster._created("ns", stray)
    cluster.pod_event("ADDED", stray)
    assert names(cluster) == {"tj-worker-0": "Pending"}
    assert names(cluster, "other") == {"other-worker-0": "Pending"}


def test_a_pod_the_operator_deleted_reads_as_deleting_until_its_watch_says_gone() -> None:
    cluster, index = watched()
    index.event(cluster, "ADDED", pod("tj-worker-0", "10", phase="Running"))
    cluster._deleting("ns", "tj-worker-0", "uid-tj-worker-0")
    (state,) = [kube.pod_state(p, "job-uid") for p in cluster.pods("ns", "tj")]
    assert state is not None
    assert state.deleting
    index.event(cluster, "DELETED", pod("tj-worker-0", "11"))
    assert names(cluster) == {}
    assert cluster._deleted == {}


def test_a_successor_of_a_deleted_pod_is_not_read_as_deleting() -> None:
    """The deletion's watch event may come before the DELETE's answer: the mark, left behind,
    must not make the replacement of the same name read as deleting for ever."""
    cluster, index = watched()
    index.event(cluster, "ADDED", pod("tj-worker-0", "10", phase="Running"))
    index.event(cluster, "DELETED", pod("tj-worker-0", "11"))
    cluster._deleting("ns", "tj-worker-0", "uid-tj-worker-0")  # the answer, late
    successor = pod("tj-worker-0", "20")
    successor["metadata"]["uid"] = "uid-successor"
    index.event(cluster, "ADDED", successor)
    (state,) = [kube.pod_state(p, "job-uid") for p in cluster.pods("ns", "tj")]
    assert state is not None
    assert not state.deleting


def certificate(folder: Path) -> tuple[bytes, bytes]:
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            "/CN=test",
            "-days",
            "1",
            "-keyout",
            str(folder / "k.pem"),
            "-out",
            str(folder / "c.pem"),
        ],
        check=True,
        capture_output=True,
    )
    return (folder / "c.pem").read_bytes(), (folder / "k.pem").read_bytes()


def kubeconfig(folder: Path, user: dict[str, Any], cluster: dict[str, Any]) -> Path:
    import yaml

    path = folder / "config"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
            }
        )
    )
    return path


def test_a_kubeconfig_with_inline_certificates_loads_and_with_a_token(tmp_path: Path) -> None:
    cert, key = certificate(tmp_path)
    b64 = {"c": base64.b64encode(cert).decode(), "k": base64.b64encode(key).decode()}
    loaded = kubeclient.load(
        kubeconfig=str(
            kubeconfig(
                tmp_path,
                {"client-certificate-data": b64["c"], "client-key-data": b64["k"]},
                {"server": "https://127.0.0.1:6443", "certificate-authority-data": b64["c"]},
            )
        )
    )
    assert loaded.configuration.host == "https://127.0.0.1:6443"
    assert loaded.configuration.cert_file
    assert loaded.configuration.key_file
    assert not loaded.in_cluster
    token = kubeclient.load(
        kubeconfig=str(
            kubeconfig(
                tmp_path,
                {"token": "abc"},
                {"server": "https://[::1]:8443", "certificate-authority": "c.pem"},
            )
        )
    )
    assert token.configuration.host == "https://[::1]:8443"
    assert token.configuration.get_api_key_with_prefix("BearerToken") == "Bearer abc"


def test_a_kubeconfig_whose_user_runs_an_exec_plugin_loads_its_token(tmp_path: Path) -> None:
    plugin = tmp_path / "credential-plugin"
    plugin.write_text(
        "#!/bin/sh\n"
        'echo \'{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",'
        ' "status": {"token": "from-the-plugin"}}\'\n'
    )
    plugin.chmod(0o755)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(plugin),
            "interactiveMode": "Never",
        }
    }
    loaded = kubeclient.load(
        kubeconfig=str(kubeconfig(tmp_path, user, {"server": "https://127.0.0.1:6443"}))
    )
    assert loaded.configuration.get_api_key_with_prefix("BearerToken") == "Bearer from-the-plugin"


def test_no_kubeconfig_and_no_pod_is_refused_naming_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("KUBECONFIG", str(missing))
    with pytest.raises(kubeclient.LoadError, match="no Kubernetes credentials") as err:
        kubeclient.load()
    assert "not in a pod" in str(err.value)


class ReadChildren(kube.KubeCluster):
    """A KubeCluster whose three reads of a job's children answer from `there`."""

    def __init__(self, there: tuple[list[str] | None, bool, bool]) -> None:
        super().__init__(api=None)
        self.there = there
        self.changed = ""  # how the Secret was changed, when it was
        self.reads_made = 0

    def _read_children(
        self,
        job: Any,
        *,
        at_once: bool = True,
        taken: list[str] | None = None,
        changed: list[str] | None = None,
    ) -> tuple[list[str] | None, bool, bool]:
        self.reads_made += 1
        if self.changed and changed is not None:
            changed.append(self.changed)
        return self.there


JOB = {"metadata": {"namespace": "ns", "name": "tj", "uid": "u1"}, "spec": {}}


@pytest.mark.parametrize("gone", ["secret", "network policy", "service", "secret changed"])
def test_children_read_again_in_the_background_once_due_and_one_gone_asks_for_a_pass(
    monkeypatch: pytest.MonkeyPatch, gone: str
) -> None:
    cluster = ReadChildren((["tj-chief-0.crt"], True, True))
    asked: list[tuple[str, str]] = []
    cluster.on_gone = lambda namespace, name: asked.append((namespace, name))
    cluster._keep(JOB["metadata"], ["tj-chief-0.crt"])
    assert cluster._kept(JOB) == ["tj-chief-0.crt"]
    assert cluster.reads_made == 0  # not due: nothing read
    monkeypatch.setattr(kube, "KEPT_FOR", -1.0)  # due at once
    cluster._keep(JOB["metadata"], ["tj-chief-0.crt"])
    keys: list[str] | None = None if gone == "secret" else ["tj-chief-0.crt"]
    cluster.there = (keys, gone != "network policy", gone != "service")
    cluster.changed = "its data no longer has the digest it was made with" * (
        gone == "secret changed"
    )
    assert cluster._kept(JOB) == ["tj-chief-0.crt"]  # this pass goes on with what was read
    cluster.reads.shutdown(wait=True)  # the read again is done
    assert cluster.reads_made == 1
    assert asked == [("ns", "tj")]
    assert cluster._kept(JOB) is None  # the next pass reads them itself, and makes what is gone


def test_children_read_again_and_all_there_are_kept_with_no_pass_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = ReadChildren((["tj-chief-0.crt", "tj-ps-0.crt"], True, True))
    asked: list[tuple[str, str]] = []
    cluster.on_gone = lambda namespace, name: asked.append((namespace, name))
    monkeypatch.setattr(kube, "KEPT_FOR", -1.0)  # due at once
    cluster._keep(JOB["metadata"], ["tj-chief-0.crt"])
    assert cluster._kept(JOB) == ["tj-chief-0.crt"]
    cluster.reads.shutdown(wait=True)
    assert (cluster.reads_made, asked) == (1, [])
    with cluster._lock:  # kept as read again: the Secret's keys of now
        assert cluster._known[("ns", "tj", "u1")][1] == ["tj-chief-0.crt", "tj-ps-0.crt"]


def test_a_deleted_child_seen_by_the_watch_is_read_again_on_the_next_pass() -> None:
    cluster = ReadChildren((["tj-chief-0.crt"], True, True))
    cluster._keep(JOB["metadata"], ["tj-chief-0.crt"])
    cluster.child_deleted("ns", "other")  # another job's: this one's stays kept
    assert cluster._kept(JOB) == ["tj-chief-0.crt"]
    cluster.child_deleted("ns", "tj")
    assert cluster._kept(JOB) is None
