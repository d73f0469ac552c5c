"""The job's TLS material is kept whole: its Secret gone while pods run with its keys fails the
job naming it (a replaced pod would get keys its peers do not trust); gone while no pod runs
(suspended), every task gets keys of one new CA."""

from __future__ import annotations

from tests.unit.test_reconcile import cond, started


def test_a_secret_deleted_while_the_pods_run_fails_the_job_naming_it_and_issues_nothing() -> None:
    memory, run = started()
    assert memory.issued == 1
    memory.secrets.clear()  # kubectl delete secret tj-tls-u-1
    assert run().state == "Failed"
    failed = cond(memory, "Failed")
    assert failed["reason"] == "SecretLost"
    assert failed["message"].startswith(
        "the job's Secret tj-tls-u-1 (its tasks' TLS credentials) is gone while pod"
    )
    assert memory.secrets == {}  # no second CA beside the pods' own
    assert memory.pods == {}  # cleanPodPolicy Running: a failed job's pods go at once


def test_a_secret_deleted_while_suspended_is_issued_again_before_any_pod_starts() -> None:
    memory, run = started()
    assert memory.job is not None
    memory.job["spec"]["runPolicy"]["suspend"] = True
    memory.job["metadata"]["generation"] = 2
    run()
    run()
    assert memory.pods == {}
    memory.secrets.clear()
    memory.job["spec"]["runPolicy"]["suspend"] = False
    memory.job["metadata"]["generation"] = 3
    assert run().state != "Failed"
    assert memory.issued == 2
    assert list(memory.secrets) == ["tj-tls-u-1"]
    assert sorted(memory.pods) == ["tj-ps-0", "tj-worker-0", "tj-worker-1"]
