"""The operator's work queue (threads, no API): dedup, one pass per key, timers, the per-key
backoff after failed passes, and workers in other threads woken by an add or a shutdown."""

from __future__ import annotations

import random
import threading
import time

import pytest

from jaxps_operator.kube import pod_state
from jaxps_operator.workqueue import Backoff, WorkQueue

A, B = ("ns", "a"), ("ns", "b")


def test_a_key_added_twice_is_queued_once() -> None:
    queue = WorkQueue()
    queue.add(("ns", "a"))
    queue.add(("ns", "a"))
    queue.add(("ns", "b"))
    assert len(queue) == 2
    assert queue.get(timeout=1) == ("ns", "a")
    assert queue.get(timeout=1) == ("ns", "b")
    assert len(queue) == 0


def test_a_key_added_during_its_pass_runs_again_after_it_not_alongside() -> None:
    queue = WorkQueue()
    queue.add(("ns", "a"))
    key = queue.get(timeout=1)
    assert key is not None
    queue.add(key)  # an event while the pass runs
    assert len(queue) == 0  # not handed to a second worker
    queue.done(key)
    assert len(queue) == 1
    assert queue.get(timeout=1) == key


def test_the_earliest_timer_wins() -> None:
    queue = WorkQueue()
    queue.add_after(("ns", "a"), 30.0)
    queue.add_after(("ns", "a"), 0.01)  # earlier: replaces the 30 s timer
    queue.add_after(("ns", "a"), 60.0)  # later: ignored
    assert queue.get(timeout=5) == ("ns", "a")
    queue.done(("ns", "a"))
    assert ("ns", "a") not in queue.tracked()
    queue.add_after(("ns", "b"), 30.0)
    queue.forget(("ns", "b"))
    assert queue.tracked() == set()


def test_the_backoff_doubles_with_each_failure_in_a_row_of_one_key() -> None:
    backoff = Backoff(initial=0.5, cap=100.0, jitter=0.0)
    assert [backoff.failed(A) for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert backoff.failures(A) == 5
    assert backoff.failed(B) == 0.5  # another key's failures are its own
    assert backoff.failures(B) == 1


def test_the_backoff_stops_growing_at_its_cap() -> None:
    backoff = Backoff(initial=1.0, cap=60.0, jitter=1.0)
    delays = [backoff.failed(A) for _ in range(200)]  # 2**199 would overflow a float's range
    assert delays[5] >= 32.0
    assert all(d == 60.0 for d in delays[6:])
    assert max(delays) == 60.0


@pytest.mark.parametrize("failure", [1, 2, 3, 4], ids=lambda n: f"failure-{n}")
def test_the_jitter_adds_at_most_its_bound_and_spreads_keys_apart(failure: int) -> None:
    random.seed(failure)
    backoff = Backoff(initial=1.0, cap=60.0, jitter=1.0)
    base = 2.0 ** (failure - 1)
    delays = []
    for key in [("ns", f"job-{k}") for k in range(100)]:
        for _ in range(failure - 1):
            backoff.failed(key)
        delays.append(backoff.failed(key))
    assert all(base <= d <= base + 1.0 for d in delays)
    assert len(set(delays)) > 90  # keys failing together do not come back together
    assert max(delays) - min(delays) > 0.5


def test_a_success_or_a_deletion_starts_the_backoff_over() -> None:
    queue = WorkQueue(Backoff(initial=1.0, cap=60.0, jitter=0.0))
    assert [queue.retry(A) for _ in range(3)] == [1.0, 2.0, 4.0]
    queue.succeeded(A)
    assert queue.backoff.failures(A) == 0
    assert queue.retry(A) == 1.0
    queue.retry(B)
    queue.retry(B)
    queue.forget(B)
    assert queue.backoff.failures(B) == 0
    assert B not in queue.tracked()
    assert queue.retry(B) == 1.0
    queue.forget(A)
    queue.forget(B)


def test_a_failed_key_comes_back_after_its_delay_not_at_once() -> None:
    queue = WorkQueue(Backoff(initial=0.05, cap=60.0, jitter=0.0))
    queue.add(A)
    key = queue.get(timeout=1)
    assert key == A
    assert queue.retry(A) == 0.05  # the pass failed
    queue.done(A)
    assert len(queue) == 0
    assert A in queue.tracked()  # waiting on its timer
    assert queue.get(timeout=5) == A


def test_a_requeue_due_sooner_than_the_backoff_still_wins() -> None:
    queue = WorkQueue(Backoff(initial=30.0, cap=60.0, jitter=0.0))
    queue.add_after(A, 0.01)  # a Plan's requeue_after
    assert queue.retry(A) == 30.0
    assert queue.get(timeout=5) == A


def test_a_worker_waiting_in_another_thread_takes_a_key_added_from_a_third() -> None:
    queue = WorkQueue()
    taken: list[tuple[str, str] | None] = []
    worker = threading.Thread(target=lambda: taken.append(queue.get(timeout=30)))
    worker.start()
    threading.Thread(target=queue.add, args=(A,)).start()  # as a watch's thread does
    worker.join(30)
    assert taken == [A]


def test_a_key_in_a_pass_is_handed_to_no_second_worker_until_done() -> None:
    queue = WorkQueue()
    queue.add(A)
    assert queue.get(timeout=1) == A
    queue.add(A)  # an event during the pass
    second: list[tuple[str, str] | None] = []
    waiter = threading.Thread(target=lambda: second.append(queue.get(timeout=30)))
    waiter.start()
    assert queue.get(timeout=0.05) is None  # nothing else to hand out meanwhile
    assert second == []
    queue.done(A)  # the pass ended: the key runs once more, in the waiting worker
    waiter.join(30)
    assert second == [A]


def test_a_forgotten_timer_adds_nothing() -> None:
    queue = WorkQueue()
    queue.add_after(A, 0.01)
    queue.forget(A)
    queue.add_after(B, 0.05)
    assert queue.get(timeout=5) == B  # A's timer, due first, was skipped


def test_shutting_down_wakes_every_waiting_worker_with_none() -> None:
    queue = WorkQueue()
    queue.add_after(A, 60.0)
    answers: list[tuple[str, str] | None] = []
    workers = [threading.Thread(target=lambda: answers.append(queue.get())) for _ in range(3)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 30
    queue.shut_down()
    for worker in workers:
        worker.join(max(deadline - time.monotonic(), 0))
    assert answers == [None, None, None]
    queue.add(B)
    assert queue.get() is None  # after the shutdown too


def test_pod_state_reads_phase_exit_code_readiness_and_ownership() -> None:
    pod = {
        "metadata": {
            "name": "tj-ps-0",
            "labels": {"jaxps.dev/replica-type": "ps", "jaxps.dev/replica-index": "0"},
            "ownerReferences": [{"uid": "u-1"}],
        },
        "spec": {"containers": [{"name": "jaxps"}, {"name": "sidecar"}]},
        "status": {
            "phase": "Failed",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {"name": "sidecar", "state": {"terminated": {"exitCode": 0}}},
                {
                    "name": "jaxps",
                    "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                },
            ],
        },
    }
    state = pod_state(pod, "u-1")
    assert state is not None
    assert (state.role, state.index, state.phase, state.exit_code) == ("ps", 0, "Failed", 137)
    assert state.reason == "OOMKilled"
    assert not state.ready
    assert not state.deleting
    other = pod_state(pod, "u-2")  # a pod of an earlier job of the same name: on its way out
    assert other is not None
    assert other.deleting
    assert pod_state({"metadata": {"name": "x", "labels": {}}}, "u-1") is None
