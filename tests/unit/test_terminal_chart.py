"""The loss curve `jaxps local` prints at the end."""

from __future__ import annotations

import math

from jaxps_operator.terminal_chart import chart


def test_a_falling_curve_is_tall_on_the_left_and_low_on_the_right() -> None:
    lines = chart([(s, 2.0 * math.exp(-s / 100)) for s in range(0, 600, 5)], width=40, height=4)
    rows, axis, labels = lines[:4], lines[4], lines[5]
    assert len(rows) == 4
    cells = [row.split("│", 1)[1] for row in rows]
    assert all(len(c) == 40 for c in cells)
    assert cells[0][0] == "█"  # the first column reaches the top row
    assert cells[0][-1] == " "  # the last does not
    assert cells[-1][-1] != " "  # but is drawn on the bottom row
    assert rows[0].lstrip().startswith("1.9")  # the highest column (a mean) labels the top
    assert axis.endswith("─" * 40)
    assert labels.split() == ["0", "595"]


def test_too_few_or_non_finite_points_draw_nothing() -> None:
    assert chart([]) == []
    assert chart([(1, 0.5)]) == []
    assert chart([(1, math.nan), (2, math.inf), (3, 0.5)]) == []
    flat = chart([(0, 1.0), (10, 1.0)], width=10, height=2)
    assert len(flat) == 4  # a constant loss still draws
