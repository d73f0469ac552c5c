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
    lower_is_better: bool = False,
) -> None:
    """Prints the measurement; `ratio` is above 1 when jaxps does better than the baseline:
    value / baseline for throughputs, baseline / value for times (`lower_is_better`)."""
    if not baseline_value or not value:
        ratio = None
    else:
        ratio = baseline_value / value if lower_is_better else value / baseline_value
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
