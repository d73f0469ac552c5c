"""`status.progress`: the chief's Prometheus metrics while it runs, its final summary after.

    update(previous, chief, metrics) -> progress

One function for both backends, called by the reconcile pass: the `Cluster` reads the chief's
metrics (the pod's IP and its port named `metrics` on Kubernetes, 127.0.0.1 locally) and its
termination message (the container's `terminated.message` on Kubernetes, the file the local
backend gives as JAXPS_TERMINATION_LOG). Once the chief has ended, its final JSON summary makes
the progress final: the last step and the evaluation, which metrics read mid-run can miss.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Mapping
from typing import Any

from jaxps_operator.objects import PodState

TIMEOUT_SECONDS = 1.0


def read_metrics(address: str) -> dict[str, float]:
    """The jaxps_* metrics a task serves at host:port, by name (eval metrics as eval/<name>);
    {} if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=TIMEOUT_SECONDS) as reply:
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


def of_task(pod: PodState) -> dict[str, float]:
    """The metrics a running task serves (what `Cluster.task_progress` gives); {} without."""
    return read_metrics(pod.metrics) if pod.metrics else {}


def update(
    previous: Mapping[str, Any], *, chief: PodState | None, metrics: Mapping[str, float]
) -> dict[str, Any]:
    """The progress after a pass: final once the chief's termination message holds its
    summary, else `previous` updated with its metrics (unchanged when there are none)."""
    done = summary(chief.message) if chief is not None else None
    if done is not None:
        return final(previous, done)
    return merge(previous, metrics)


def merge(previous: Mapping[str, Any], metrics: Mapping[str, float]) -> dict[str, Any]:
    """`previous` progress updated with what the metrics say (unchanged when they are empty)."""
    progress = dict(previous)
    if metrics:
        step = int(metrics.get("jaxps_global_step", 0))
        progress.update(
            {
                "step": step,
                "stepsPerSecond": round(metrics.get("jaxps_steps_per_second", 0.0), 2),
                "lastCheckpointStep": int(metrics.get("jaxps_last_checkpoint_step", 0)),
            }
        )
        if step > 0 and "jaxps_loss" in metrics:  # no loss before the first step
            progress["loss"] = metrics["jaxps_loss"]
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
