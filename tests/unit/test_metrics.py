"""The task's HTTP port: Prometheus metrics, and health for the kubelet (no certificate)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from jaxps_operator import builders
from jaxps_runtime.process import metrics as task_metrics


@pytest.fixture
def served() -> Iterator[tuple[task_metrics.Metrics, int]]:
    m = task_metrics.Metrics(task="ps-0")
    port = m.serve(0, host="127.0.0.1")
    assert port is not None
    yield m, port
    m.close()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_live_at_once_ready_only_while_the_task_serves(
    served: tuple[task_metrics.Metrics, int],
) -> None:
    m, port = served
    assert get(port, "/healthz") == (200, "ok\n")
    assert get(port, "/readyz") == (503, "not serving\n")
    m.ready.set()
    assert get(port, "/readyz") == (200, "ok\n")
    m.ready.clear()
    assert get(port, "/readyz")[0] == 503
    assert get(port, "/healthz")[0] == 200


def test_the_metrics_are_on_their_path_only(served: tuple[task_metrics.Metrics, int]) -> None:
    m, port = served
    m.global_step.set(7)
    code, body = get(port, "/metrics")
    assert code == 200
    assert 'jaxps_global_step{task="ps-0"} 7.0' in body
    assert get(port, "/")[0] == 404


def test_the_pods_probe_the_paths_the_runtime_serves() -> None:
    assert builders.LIVE_PATH == task_metrics.LIVE_PATH
    assert builders.READY_PATH == task_metrics.READY_PATH


def test_no_loss_is_served_until_one_is_known(
    served: tuple[task_metrics.Metrics, int],
) -> None:
    """An unset gauge reads 0.0: a chief that has not heard a worker's loss yet would report a
    loss of 0 (the control plane shows what it reads)."""
    m, port = served
    assert "jaxps_loss{" not in get(port, "/metrics")[1]
    m.loss.set(0.25)
    assert 'jaxps_loss{task="ps-0"} 0.25' in get(port, "/metrics")[1]
