"""`status.progress` from the chief's Prometheus metrics (DESIGN.md section 3).

Both backends read it the same way: `jaxps local` from 127.0.0.1, the operator from the chief
pod's IP and its container port named `metrics`. Once the chief has ended, its final JSON summary
(the last line of its log locally, its container's termination message on Kubernetes) makes the
progress final: the last step and the evaluation, which metrics read mid-run can miss.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Mapping
from typing import Any

TIMEOUT_SECONDS = 1.0


def read_metrics(host: str, port: int) -> dict[str, float]:
    """The jaxps_* metrics a task serves, by name (eval metrics as eval/<name>); {} if down."""
    try:
        with urllib.request.urlopen(
            f"http://{host}:{port}/metrics", timeout=TIMEOUT_SECONDS
        ) as reply:
            text = reply.read().decode()
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("jaxps_") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        metric = re.search(r'metric="([^"]+)"', rest)
        key = f"eval/{metric.group(1)}" if name == "jaxps_eval" and metric else name
        try:
            out[key] = float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return out


def merge(previous: Mapping[str, Any], metrics: Mapping[str, float]) -> dict[str, Any]:
    """`previous` progress updated with what the metrics say (unchanged when they are empty)."""
    progress = dict(previous)
    if metrics:
        progress.update(
            {
                "step": int(metrics.get("jaxps_global_step", 0)),
                "loss": metrics.get("jaxps_loss", 0.0),
                "stepsPerSecond": round(metrics.get("jaxps_steps_per_second", 0.0), 2),
                "lastCheckpointStep": int(metrics.get("jaxps_last_checkpoint_step", 0)),
            }
        )
        evals = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("eval/")}
        if evals:
            progress["eval"] = evals
    return progress


def summary(text: str | None) -> dict[str, Any] | None:
    """The chief's `{"event": "done", ...}` line in `text` (its log or termination message)."""
    for line in reversed((text or "").splitlines()):
        if line.startswith('{"event": "done"'):
            try:
                found = json.loads(line)
            except ValueError:
                return None
            return found if isinstance(found, dict) else None
    return None


def final(previous: Mapping[str, Any], done: Mapping[str, Any]) -> dict[str, Any]:
    """`previous` progress completed with the chief's final summary `done`."""
    progress = dict(previous)
    progress["step"] = done.get("step", progress.get("step", 0))
    for key in ("loss", "stepsPerSecond", "lastCheckpointStep"):
        if done.get(key) is not None:
            progress[key] = done[key]
    evals = {k: v for k, v in (done.get("eval") or {}).items() if v is not None}
    if evals:
        progress["eval"] = evals
    return progress
