"""One JSON line per measurement, in the format DEVELOPERS.md gives for every bench script."""

from __future__ import annotations

import json


def emit(
    bench: str,
    case: str,
    *,
    metric: str,
    value: float,
    unit: str,
    baseline: str | None = None,
    baseline_value: float | None = None,
) -> None:
    """Prints the measurement; `ratio` = value / baseline_value (oriented by the caller)."""
    ratio = value / baseline_value if baseline_value else None
    print(
        json.dumps(
            {
                "bench": bench,
                "case": case,
                "metric": metric,
                "value": round(value, 4),
                "unit": unit,
                "baseline": baseline,
                "baseline_value": round(baseline_value, 4) if baseline_value else None,
                "ratio": round(ratio, 3) if ratio else None,
            }
        ),
        flush=True,
    )
