"""The pods a pass reads from the pod watch (`KubeCluster.pod_seen`), kept slim; the namespace
globs of the watches; the kubeconfig the operator's API client reads; and when a job's Secret,
NetworkPolicy and Service are read again."""

from __future__ import annotations

import base64
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from jaxps_operator import apiserver, controller, kube


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


def watched() -> kube.KubeCluster:
    return kube.KubeCluster(network_policies=False, pods_watched=lambda: True)


def names(cluster: kube.KubeCluster) -> dict[str, str]:
    return {p["metadata"]["name"]: p["status"].get("phase", "") for p in cluster.pods("ns", "tj")}


def test_a_slim_pod_reads_as_the_whole_pod_and_is_a_fraction_of_its_size() -> None:
    whole = pod("tj-worker-1", "10", phase="Running")
    slim = kube.slim_pod(whole)
    assert kube.pod_state(slim, "job-uid") == kube.pod_state(whole, "job-uid")
    assert len(repr(slim)) * 5 < len(repr(whole))


def test_the_newest_version_of_a_pod_is_kept_and_a_late_older_event_is_dropped() -> None:
    cluster = watched()
    cluster.pod_seen("ADDED", pod("tj-worker-0", "10"))
    cluster.pod_seen("MODIFIED", pod("tj-worker-0", "12", phase="Running"))
    cluster.pod_seen("MODIFIED", pod("tj-worker-0", "11", phase="Pending"))  # behind
    assert names(cluster) == {"tj-worker-0": "Running"}


def test_a_deleted_pod_is_not_brought_back_by_a_late_event_but_its_successor_is_kept() -> None:
    cluster = watched()
    cluster.pod_seen("ADDED", pod("tj-worker-0", "10"))
    cluster.pod_seen("DELETED", pod("tj-worker-0", "15"))
    assert names(cluster) == {}
    cluster.pod_seen("MODIFIED", pod("tj-worker-0", "14", phase="Running"))  # late
    assert names(cluster) == {}
    cluster.pod_seen("ADDED", pod("tj-worker-0", "20"))  # the replacement, same name
    assert names(cluster) == {"tj-worker-0": "Pending"}


def test_pods_are_kept_per_job_and_a_pod_without_the_job_label_is_ignored() -> None:
    cluster = watched()
    cluster.pod_seen("ADDED", pod("tj-worker-0", "10"))
    cluster.pod_seen("ADDED", pod("other-worker-0", "11", job="other"))
    stray = pod("stray-0", "12")
    del stray["metadata"]["labels"]["jaxps.dev/job-name"]
    cluster.pod_seen("ADDED", stray)
    assert names(cluster) == {"tj-worker-0": "Pending"}
    assert [p["metadata"]["name"] for p in cluster.pods("ns", "other")] == ["other-worker-0"]


def test_a_pod_the_operator_deleted_reads_as_deleting_until_its_watch_says_gone() -> None:
    cluster = watched()
    cluster.pod_seen("ADDED", pod("tj-worker-0", "10", phase="Running"))
    cluster._deleting("ns", "tj-worker-0", "tj")
    (state,) = [kube.pod_state(p, "job-uid") for p in cluster.pods("ns", "tj")]
    assert state is not None
    assert state.deleting
    cluster.pod_seen("DELETED", pod("tj-worker-0", "11"))
    assert names(cluster) == {}


@pytest.mark.parametrize(
    ("patterns", "accepted", "refused"),
    [
        ((), ["a", "team-x"], []),
        (("team-*",), ["team-a", "team-b"], ["teams", "default"]),
        (("team-*", "!team-secret"), ["team-a"], ["team-secret", "default"]),
        (("!kube-*",), ["default", "team-a"], ["kube-system"]),
    ],
    ids=["all", "glob", "glob-less-one", "all-but"],
)
def test_namespace_globs_name_the_namespaces_watched(
    patterns: tuple[str, ...], accepted: list[str], refused: list[str]
) -> None:
    accept = controller.matcher(patterns)
    assert all(accept(ns) for ns in accepted)
    assert not any(accept(ns) for ns in refused)


def test_named_namespaces_get_a_watch_each_and_globs_one_on_the_cluster() -> None:
    assert controller.PODS.paths(("a", "b")) == [
        "/api/v1/namespaces/a/pods",
        "/api/v1/namespaces/b/pods",
    ]
    assert controller.JOBS.paths(("team-*",)) == ["/apis/jaxps.dev/v1alpha1/trainingjobs"]
    assert controller.SERVICES.paths(()) == ["/api/v1/services"]


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
    server = apiserver.from_kubeconfig(
        kubeconfig(
            tmp_path,
            {"client-certificate-data": b64["c"], "client-key-data": b64["k"]},
            {"server": "https://127.0.0.1:6443", "certificate-authority-data": b64["c"]},
        )
    )
    assert (server.scheme, server.host, server.port, server.token) == (
        "https",
        "127.0.0.1",
        6443,
        None,
    )
    assert server.context is not None
    assert server.context.verify_mode == ssl.CERT_REQUIRED
    token = apiserver.from_kubeconfig(
        kubeconfig(
            tmp_path,
            {"token": "abc"},
            {"server": "https://[::1]:8443", "certificate-authority": "c.pem"},
        )
    )
    assert (token.host, token.port, token.token) == ("::1", 8443, "abc")


@pytest.mark.parametrize(
    ("user", "cluster", "words"),
    [
        ({"exec": {"command": "aws"}}, {"server": "https://k"}, "users[u].exec is not supported"),
        ({"token": "t"}, {"server": "ftp://k"}, "server: got 'ftp://k'"),
    ],
    ids=["exec-plugin", "bad-server"],
)
def test_a_kubeconfig_the_operator_cannot_use_is_refused_naming_the_field(
    tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any], words: str
) -> None:
    with pytest.raises(apiserver.ConfigError, match=words.replace("[", r"\[")):
        apiserver.from_kubeconfig(kubeconfig(tmp_path, user, cluster))


class ReadChildren(kube.KubeCluster):
    """A KubeCluster whose three reads of a job's children answer from `there`."""

    def __init__(self, there: tuple[list[str] | None, bool, bool]) -> None:
        super().__init__(api=None)
        self.there = there
        self.reads_made = 0

    def _read_children(
        self, job: Any, *, at_once: bool = True
    ) -> tuple[list[str] | None, bool, bool]:
        self.reads_made += 1
        return self.there


JOB = {"metadata": {"namespace": "ns", "name": "tj", "uid": "u1"}, "spec": {}}


@pytest.mark.parametrize("gone", ["secret", "network policy", "service"])
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
