"""A curve as a few lines of text: the loss at the end of `jaxps local`.

Eight block characters per cell give each column eight levels per row; columns are the mean of
the points that fall in them (the x axis is the step, evenly spaced). About twenty lines, so no
plotting dependency in the operator's package for one small chart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

BLOCKS = " ▁▂▃▄▅▆▇█"


def chart(
    points: Sequence[tuple[float, float]], *, width: int = 60, height: int = 6, label: str = ""
) -> list[str]:
    """`points` (x, y) as `height` rows of `width` columns, with the y range on the left and
    the x range below; [] when there are fewer than two finite points."""
    finite = sorted((x, y) for x, y in points if math.isfinite(x) and math.isfinite(y))
    if len(finite) < 2 or width < 2 or height < 1:
        return []
    x0, x1 = finite[0][0], finite[-1][0]
    span = (x1 - x0) or 1.0
    columns: list[list[float]] = [[] for _ in range(width)]
    for x, y in finite:
        columns[min(int((x - x0) / span * width), width - 1)].append(y)
    means = [sum(c) / len(c) if c else None for c in columns]
    known = [m for m in means if m is not None]
    low, high = min(known), max(known)
    levels = height * 8
    scaled = [
        None if m is None else round((m - low) / ((high - low) or 1.0) * (levels - 1)) + 1
        for m in means
    ]
    rows = []
    for row in range(height - 1, -1, -1):
        cells = "".join(" " if s is None else BLOCKS[max(0, min(8, s - row * 8))] for s in scaled)
        edge = (
            f"{high:>9.4g} " if row == height - 1 else (f"{low:>9.4g} " if row == 0 else " " * 10)
        )
        rows.append(f"{edge}│{cells}")
    rows.append(" " * 10 + "└" + "─" * width)
    rows.append(
        " " * 11
        + f"{x0:<.0f}".ljust(width - len(f"{x1:.0f}"))
        + f"{x1:.0f}"
        + (f"  {label}" if label else "")
    )
    return rows
