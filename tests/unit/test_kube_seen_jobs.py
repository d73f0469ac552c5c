"""The jobs the operator's passes read: the newest body seen (watched or written), never an
older one that arrives late; gone with the job."""

from __future__ import annotations

from typing import Any

from jaxps_operator import kube


def body(version: str, *, uid: str = "u1", state: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "j", "uid": uid, "resourceVersion": version},
        "status": {"state": state},
    }


def kept(cluster: kube.KubeCluster) -> dict[str, Any] | None:
    return cluster._jobs.get(("ns", "j"))


def test_a_late_older_event_does_not_replace_a_newer_body() -> None:
    cluster = kube.KubeCluster(network_policies=False)
    cluster.seen("MODIFIED", body("120", state="Succeeded"))  # e.g. the status it wrote
    cluster.seen("MODIFIED", body("99", state="Running"))  # the watch, behind
    assert kept(cluster) == body("120", state="Succeeded")
    cluster.seen("MODIFIED", body("121", state="Succeeded"))
    assert kept(cluster) == body("121", state="Succeeded")


def test_a_new_job_of_the_same_name_replaces_the_old_one_and_deletion_forgets_it() -> None:
    cluster = kube.KubeCluster(network_policies=False)
    cluster.seen("ADDED", body("500"))
    cluster.seen("ADDED", body("7", uid="u2"))  # numbers are per object's history, not uid
    assert kept(cluster) == body("7", uid="u2")
    cluster.seen("DELETED", body("8", uid="u2"))
    assert kept(cluster) is None


def test_a_version_that_is_no_number_is_taken_as_newer() -> None:
    cluster = kube.KubeCluster(network_policies=False)
    cluster.seen("ADDED", body("10"))
    cluster.seen("MODIFIED", body("opaque"))
    assert kept(cluster) == body("opaque")
