"""The operator's work queue (pure asyncio, no API): dedup, one pass per key, timers."""

from __future__ import annotations

import asyncio

from jaxps_operator.controller import WorkQueue
from jaxps_operator.kube import pod_state


def test_a_key_added_twice_is_queued_once() -> None:
    async def scenario() -> None:
        queue = WorkQueue()
        queue.add(("ns", "a"))
        queue.add(("ns", "a"))
        queue.add(("ns", "b"))
        assert len(queue) == 2
        assert await queue.get() == ("ns", "a")
        assert await queue.get() == ("ns", "b")
        assert len(queue) == 0

    asyncio.run(scenario())


def test_a_key_added_during_its_pass_runs_again_after_it_not_alongside() -> None:
    async def scenario() -> None:
        queue = WorkQueue()
        queue.add(("ns", "a"))
        key = await queue.get()
        queue.add(key)  # an event while the pass runs
        assert len(queue) == 0  # not handed to a second worker
        queue.done(key)
        assert len(queue) == 1
        assert await asyncio.wait_for(queue.get(), 1) == key

    asyncio.run(scenario())


def test_the_earliest_timer_wins() -> None:
    async def scenario() -> None:
        queue = WorkQueue()
        queue.add_after(("ns", "a"), 30.0)
        queue.add_after(("ns", "a"), 0.01)  # earlier: replaces the 30 s timer
        queue.add_after(("ns", "a"), 60.0)  # later: ignored
        assert await asyncio.wait_for(queue.get(), 5) == ("ns", "a")
        queue.done(("ns", "a"))
        assert ("ns", "a") not in queue.tracked()
        queue.add_after(("ns", "b"), 30.0)
        queue.forget(("ns", "b"))
        assert queue.tracked() == set()

    asyncio.run(scenario())


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
