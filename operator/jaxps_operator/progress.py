"""`status.progress`: the chief's Prometheus metrics while it runs, its final summary after.

    update(previous, chief=..., metrics=..., now=...) -> progress

One function for both backends, called by the reconcile pass: the `Cluster` reads the chief's
metrics (the pod's IP and its port named `metrics` on Kubernetes, 127.0.0.1 locally) and its
termination message (the container's `terminated.message` on Kubernetes, the file the local
backend gives as JAXPS_TERMINATION_LOG). Once the chief has ended, its final JSON summary makes
the progress final: the last step and the evaluation, which metrics read mid-run can miss.
Pure but for `read_metrics`/`of_task`: the planner computes `status.progress` with `update`.
Status is strict JSON: a non-finite loss is null with a `note`; `lastCheckpointStep` appears
only once there is a checkpoint; `stepTime` is when the step last moved (the Stalled clock);
`data` is the chief's shard queue (`DATA`: epoch, shards, done, leased, leases reclaimed);
`checkpointError` says why the final checkpoint failed (the summary's words); `embeddings`, each
dynamic table over the ps at the end (the summary's).
"""

from __future__ import annotations

import json
import math
import re
import urllib.request
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from jaxps_operator.conditions import stamp
from jaxps_operator.objects import PodState

TIMEOUT_SECONDS = 1.0
CHECKPOINT_ERROR_CHARS = 1024  # of the chief's words on a failed final checkpoint
# The chief's shard queue (`status.progress.data`): metric -> key. Each is there only while the
# chief serves it (0 shards: a dataset of no known size).
DATA = {
    "jaxps_data_epoch": "epoch",
    "jaxps_data_shards": "shards",
    "jaxps_data_shards_done": "shardsDone",
    "jaxps_data_shards_leased": "shardsLeased",
    "jaxps_data_leases_reclaimed_total": "leasesReclaimed",
}


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
    previous: Mapping[str, Any],
    *,
    chief: PodState | None,
    metrics: Mapping[str, float],
    now: datetime | None = None,
) -> dict[str, Any]:
    """The progress after a pass at `now`: final once the chief's termination message holds
    its summary, else `previous` updated with its metrics (unchanged when there are none)."""
    done = summary(chief.message) if chief is not None else None
    if done is not None:
        return final(previous, done, now=now)
    return merge(previous, metrics, now=now)


def training(metrics: Mapping[str, float]) -> bool:
    """Whether the chief says it is in its training phase (`jaxps_training` 1): not starting,
    restoring, recovering, checkpointing synchronously or finishing."""
    return metrics.get("jaxps_training") == 1.0


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _loss(progress: dict[str, Any], loss: Any, step: int) -> None:
    """Sets `loss`, as null with a `note` when it is not finite: status is strict JSON (the API
    server refuses NaN and Infinity), and a null loss must still say why."""
    if _finite(loss):
        progress["loss"] = loss
        progress.pop("note", None)
    else:
        progress["loss"] = None
        progress["note"] = f"the loss at step {step} was not finite ({loss})"


def _eval_note(progress: dict[str, Any], evaluation: Mapping[str, Any]) -> None:
    """An evaluation metric that is not finite is left out of `eval` (status is strict JSON):
    the `note` names it, or it would vanish without a word (a test set with NaN features)."""
    bad = sorted(k for k, v in evaluation.items() if not _finite(v))
    if not bad:
        return
    said = f"the evaluation's {', '.join(bad)} was not finite"
    note = progress.get("note")
    progress["note"] = f"{note}; {said}" if note and said not in note else note or said


def _moved(
    progress: dict[str, Any], previous: Mapping[str, Any], *, now: datetime | None, held: bool
) -> None:
    """`stepTime`, the Stalled backstop's clock: when the step last moved. While the chief is
    not training (restoring, checkpointing synchronously) the clock is held at `now`, as the
    chief's own check holds its clock: a step that did not move then is no stall."""
    if now is None:
        return
    if held or progress.get("step") != previous.get("step") or "stepTime" not in previous:
        progress["stepTime"] = stamp(now)


def merge(
    previous: Mapping[str, Any], metrics: Mapping[str, float], *, now: datetime | None = None
) -> dict[str, Any]:
    """`previous` progress updated with what the metrics say (unchanged when they are empty).
    Every value is finite or null: a non-finite loss is null with a `note`."""
    progress = dict(previous)
    if progress.get("lastCheckpointStep") == 0:  # written by an older operator: none yet
        del progress["lastCheckpointStep"]
    if not metrics:
        return progress
    raw_step = metrics.get("jaxps_global_step", 0)
    step = int(raw_step) if _finite(raw_step) else int(progress.get("step", 0))
    rate = metrics.get("jaxps_steps_per_second", 0.0)
    progress["step"] = step
    progress["stepsPerSecond"] = round(rate, 2) if _finite(rate) else 0.0
    checkpoint = metrics.get("jaxps_last_checkpoint_step")
    if _finite(checkpoint) and checkpoint is not None and checkpoint > 0:  # 0: none yet or off
        progress["lastCheckpointStep"] = int(checkpoint)
    if step > 0 and "jaxps_loss" in metrics:  # no loss before the first step
        _loss(progress, metrics["jaxps_loss"], step)
    evals = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("eval/")}
    if evals:
        progress["eval"] = {k: v for k, v in evals.items() if _finite(v)}
        if not progress["eval"]:
            del progress["eval"]
        _eval_note(progress, evals)
    data = {key: int(metrics[name]) for name, key in DATA.items() if _finite(metrics.get(name))}
    if data:
        progress["data"] = data
    held = "jaxps_training" in metrics and not training(metrics)
    _moved(progress, previous, now=now, held=held)
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


TABLE_FIELDS = ("resident", "maxRows", "admitted", "evicted", "lookups", "hitRate")


def _tables(raw: object) -> dict[str, dict[str, float]]:
    """The summary's dynamic tables (`embeddings`: {table: {resident, maxRows, admitted,
    evicted, lookups, hitRate}}), their finite numbers only: what a chief wrote is not trusted
    to be well formed."""
    if not isinstance(raw, Mapping):
        return {}
    out = {}
    for name, part in raw.items():
        if isinstance(name, str) and isinstance(part, Mapping):
            kept = {k: part[k] for k in TABLE_FIELDS if _finite(part.get(k))}
            if kept:
                out[name] = kept
    return out


def final(
    previous: Mapping[str, Any], done: Mapping[str, Any], *, now: datetime | None = None
) -> dict[str, Any]:
    """`previous` progress completed with the chief's final summary `done`; strict JSON as
    `merge` keeps it (a non-finite loss is null with a `note`, a non-finite eval is left out)."""
    progress = dict(previous)
    if progress.get("lastCheckpointStep") == 0:
        del progress["lastCheckpointStep"]
    step = done.get("step")
    progress["step"] = step if _finite(step) else progress.get("step", 0)
    if "loss" in done and done["loss"] is not None:
        _loss(progress, done["loss"], int(progress["step"]))
    if _finite(done.get("stepsPerSecond")):
        progress["stepsPerSecond"] = done["stepsPerSecond"]
    if _finite(done.get("lastCheckpointStep")) and done["lastCheckpointStep"] > 0:
        progress["lastCheckpointStep"] = done["lastCheckpointStep"]
    evaluation = done.get("eval") or {}
    evals = {k: v for k, v in evaluation.items() if _finite(v)}
    if evals:
        progress["eval"] = evals
    _eval_note(progress, evaluation)
    tables = _tables(done.get("embeddings"))
    if tables:
        progress["embeddings"] = tables
    error = done.get("checkpointError")
    if isinstance(error, str) and error:  # trained, but the last steps are in no checkpoint
        progress["checkpointError"] = error[:CHECKPOINT_ERROR_CHARS]
    _moved(progress, previous, now=now, held=False)
    return progress
