"""Global steps per second from workers' spans (what the chief's summary reports)."""

from __future__ import annotations

import pytest

from jaxps_runtime.train.timing import overlap_steps_per_second


def test_side_by_side_workers_give_the_rate_of_the_common_window() -> None:
    spans = [(0.0, 0.0, 10.0, 1000.0), (1.0, 100.0, 11.0, 1100.0)]
    # From t=1 (step 100, the later start) to t=10 (step 1000, the earlier finish).
    assert overlap_steps_per_second(spans) == pytest.approx(100.0)


def test_a_late_worker_does_not_count_the_others_solo_steps_twice() -> None:
    # Worker 0 trained alone at 200 steps/s until worker 1 came; then both at 100 steps/s.
    spans = [(0.0, 0.0, 8.0, 1400.0), (5.0, 1000.0, 9.0, 1500.0)]
    assert overlap_steps_per_second(spans) == pytest.approx(400 / 3)


def test_without_a_common_window_it_is_the_whole_span() -> None:
    spans = [(0.0, 0.0, 4.0, 400.0), (6.0, 400.0, 7.0, 450.0)]
    assert overlap_steps_per_second(spans) == pytest.approx(450 / 7)


def test_no_spans_is_no_rate() -> None:
    assert overlap_steps_per_second([]) == 0.0
