"""The chief's view of its workers: who counts as alive (`coordinator.Membership`)."""

from __future__ import annotations

from jaxps.v1 import coordinator_pb2 as co_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.train.coordinator import Membership


def _heartbeat(task: str, *, done: bool = False) -> co_pb2.HeartbeatRequest:
    return co_pb2.HeartbeatRequest(
        id=tensor_pb2.Identity(job_id="j", task=task), task_incarnation=1, done=done
    )


def test_a_worker_is_alive_until_it_is_not_heard_from_for_the_timeout() -> None:
    members = Membership(job_id="j", workers=["worker-0", "worker-1"], now=0.0)
    members.seen(_heartbeat("worker-1"), now=4.0)
    assert members.live_workers(now=5.0, timeout=5.0) == ["worker-0", "worker-1"]
    assert members.live_workers(now=8.0, timeout=5.0) == ["worker-1"]
    assert members.live_workers(now=10.0, timeout=5.0) == []


def test_a_done_worker_stays_counted() -> None:
    members = Membership(job_id="j", workers=["worker-0"], now=0.0)
    members.seen(_heartbeat("worker-0", done=True), now=1.0)
    assert members.live_workers(now=100.0, timeout=5.0) == ["worker-0"]


def test_the_clock_starts_when_the_chief_starts_watching() -> None:
    # The ps took 30 s to come up: nobody is declared dead for the wait before the watch.
    members = Membership(job_id="j", workers=["worker-0", "worker-1"], now=0.0)
    members.seen(_heartbeat("worker-1"), now=2.0)
    members.watching_from(30.0)
    assert members.live_workers(now=34.0, timeout=5.0) == ["worker-0", "worker-1"]
    members.seen(_heartbeat("worker-1"), now=36.0)
    assert members.live_workers(now=40.0, timeout=5.0) == ["worker-1"]
    members.watching_from(10.0)  # never moves a later sighting back
    assert members.live_workers(now=40.0, timeout=5.0) == ["worker-1"]


def test_the_chief_knows_which_live_workers_were_told_to_stop() -> None:
    members = Membership(job_id="j", workers=["worker-0", "worker-1", "worker-2"], now=0.0)
    members.seen(_heartbeat("worker-0", done=True), now=1.0)
    members.seen(_heartbeat("worker-1", done=True), now=1.0)
    members.told_stop("worker-0")
    # worker-2 is not heard from within the timeout: dead, nobody waits for its word
    assert members.not_told(now=7.0, timeout=6.5) == ["worker-1"]
    members.told_stop("worker-1")
    assert members.not_told(now=7.0, timeout=6.5) == []


def test_a_heartbeat_says_what_the_task_waits_for() -> None:
    members = Membership(job_id="j", workers=["worker-0"], now=0.0)
    beat = _heartbeat("worker-0")
    beat.waiting = "the parameters of step >= 4 from every ps (Read)"
    members.seen(beat, now=1.0)
    member = members.member("worker-0")
    assert member is not None
    assert member.waiting == beat.waiting
