"""The chief's check that a finite loss did not only grow (`divergence.grown`), and the first
loss it measures against (`divergence.first_loss`, from the workers' heartbeats)."""

from __future__ import annotations

import math

import pytest

from jaxps_runtime.train import divergence
from jaxps_runtime.train.coordinator import Member


@pytest.mark.parametrize(
    ("first", "final", "diverged"),
    [
        (2.3, 775_477.0, True),
        (2.3, 24.0, True),  # more than 10 times and more than 1 higher
        (2.3, 22.0, False),  # 9.6 times
        (0.05, 0.6, False),  # a converged model's noisy batch: 12 times, but 0.55 higher
        (2.3, 0.1, False),  # it trained
        (2.3, math.nan, False),  # not finite: the other checks' to judge
        (1000.0, 12_000.0, True),
    ],
)
def test_a_loss_diverged_only_when_it_grew_tenfold_and_by_more_than_one(
    first: float, final: float, diverged: bool
) -> None:
    said = divergence.grown((0, first), step=50, loss=final)
    assert (said is not None) == diverged, said
    if said is not None:
        assert f"grew from {first:.4g} (step 0) to {final:.4g} (step 50)" in said


def test_nothing_to_compare_with_is_no_divergence() -> None:
    assert divergence.grown(None, step=50, loss=1e9) is None


def test_the_first_loss_is_of_the_earliest_first_step_any_worker_reported() -> None:
    def member(task: str, metrics: dict[str, float]) -> Member:
        return Member(task, last_seen=0.0, metrics=metrics)

    members = [
        member("worker-0", divergence.first_loss_report(step=3, loss=2.1)),
        member("worker-1", divergence.first_loss_report(step=0, loss=2.4)),
        member("worker-2", {}),  # no step trained yet
        member("evaluator-0", divergence.first_loss_report(step=0, loss=0.1)),  # not a worker
    ]
    workers = ["worker-0", "worker-1", "worker-2"]
    assert divergence.first_loss(members, workers=workers) == (0, 2.4)
    assert divergence.first_loss(members[2:], workers=workers) is None
