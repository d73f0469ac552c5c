"""`stopping.Stop`: how a task's loops learn it is told to stop (no processes, no network)."""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from jaxps_runtime.client import placement
from jaxps_runtime.client.psclient import PsClient
from jaxps_runtime.process import stopping


def test_a_stop_runs_each_callback_once_and_late_ones_at_once() -> None:
    stop = stopping.Stop()
    calls: list[str] = []
    stop.callback(lambda: calls.append("early"))
    unregister = stop.callback(lambda: calls.append("unregistered"))
    unregister()
    stop.request(signal.SIGTERM)
    stop.request(signal.SIGTERM)
    stop.callback(lambda: calls.append("late"))
    assert calls == ["early", "late"]


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["term", "int"]
)
def test_the_exit_code_is_128_plus_the_first_signal(signum: signal.Signals, code: int) -> None:
    stop = stopping.Stop()
    stop.mark(signum)
    stop.mark(signal.SIGHUP)
    assert stop.exit_code == code
    assert stop.reason == signum.name


def test_a_marked_stop_is_seen_at_once_and_its_callbacks_wait_for_the_request() -> None:
    stop = stopping.Stop()
    calls: list[str] = []
    stop.callback(lambda: calls.append("called"))
    stop.mark(signal.SIGTERM)  # what the signal handler does
    assert stop.is_set
    with pytest.raises(stopping.Stopped, match="stopping on SIGTERM"):
        stop.check()
    assert calls == []
    assert not stop.is_requested
    stop.request(signal.SIGTERM)  # what the watcher thread does next
    assert calls == ["called"]
    assert stop.is_requested


def test_sleep_returns_when_not_stopped_and_raises_as_soon_as_stopped() -> None:
    stop = stopping.Stop()
    stop.sleep(0.01)
    threading.Timer(0.05, stop.request).start()
    with pytest.raises(stopping.Stopped):
        stop.sleep(60)


def test_stopped_is_no_exception_that_failure_paths_catch() -> None:
    assert not issubclass(stopping.Stopped, Exception)


def _client(stop: stopping.Stop) -> PsClient:
    shapes = {"w": np.zeros(4, np.float32)}
    plan = placement.plan(placement.variables_of(shapes), num_ps=1)
    # Nothing listens there: the client must refuse before it calls anything.
    return PsClient(
        addresses=["127.0.0.1:9"], placement=plan, job_id="job", task="chief-0", stop=stop
    )


def test_a_stopping_client_starts_no_push_and_no_shutdown() -> None:
    stop = stopping.Stop()
    client = _client(stop)
    stop.request(signal.SIGTERM)
    with pytest.raises(stopping.Stopped):
        client.update({"['w']": np.ones(4, np.float32)}, step=0)
    with pytest.raises(stopping.Stopped):
        client.shutdown(reason="training done")
    with pytest.raises(stopping.Stopped):
        client.wait_ready(timeout=60)
    client.close()
