"""The chief's summary as the termination log keeps it: whole, however long the job's history."""

from __future__ import annotations

import json
from typing import Any

from jaxps_operator import progress
from jaxps_runtime.process import termination
from jaxps_runtime.train.chief.finish import recorded


def done(recoveries: int = 0, metrics: int = 1, error: str | None = None) -> dict[str, Any]:
    return {
        "event": "done",
        "step": 600,
        "loss": 0.1,
        "eval": {f"metric_{i:03d}_with_a_long_name": 0.5 for i in range(metrics)},
        "startedFrom": {},
        "lastCheckpointStep": 600,
        "checkpointError": error,
        "recoveries": [
            {"reason": f"ps {i % 2} was replaced (incarnation {i})", "fromStep": i, "toStep": i}
            for i in range(recoveries)
        ],
    }


def kept(summary: dict[str, Any]) -> dict[str, Any]:
    """What the control plane reads back from the termination log."""
    text = termination.message([recorded(summary)])
    found = progress.summary(text)
    assert found is not None, text
    return found


def test_a_short_summary_is_recorded_as_it_is() -> None:
    summary = done(recoveries=2, metrics=3)
    assert kept(summary) == json.loads(json.dumps(summary))


def test_many_recoveries_keep_the_newest_and_count_the_rest() -> None:
    summary = done(recoveries=200)
    found = kept(summary)
    assert found["step"] == 600
    assert found["recoveries"][-1] == summary["recoveries"][-1]
    assert found["recoveriesLeftOut"] + len(found["recoveries"]) == 200
    assert found["recoveriesLeftOut"] > 0


def test_many_metrics_and_a_long_checkpoint_error_still_leave_a_whole_summary() -> None:
    summary = done(recoveries=50, metrics=500, error="no space left on device: " + "x" * 9000)
    found = kept(summary)
    assert found["loss"] == 0.1
    assert found["evalLeftOut"] + len(found["eval"]) == 500
    assert found["checkpointError"].startswith("no space left on device")
    assert len((json.dumps(found) + "\n").encode()) <= termination.LIMIT_BYTES


def test_many_dynamic_tables_keep_the_largest_and_count_the_rest() -> None:
    summary = done(recoveries=3)
    summary["embeddings"] = {
        f"C{i}": {
            "resident": 1000 * i,
            "maxRows": 10**6,
            "admitted": 10**7,
            "evicted": 10**7,
            "lookups": 10**9,
            "hitRate": 0.9876,
        }
        for i in range(1, 60)
    }
    found = kept(summary)
    assert found["recoveries"] == summary["recoveries"]  # tables give way first
    assert found["embeddingsLeftOut"] + len(found["embeddings"]) == 59
    assert "C59" in found["embeddings"]  # the largest are kept
    assert "C1" not in found["embeddings"]
