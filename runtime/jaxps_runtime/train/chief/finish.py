"""The end of a job at its last step, as the chief does it: drains the workers and the
evaluator, reads the final parameters, checkpoints, evaluates (unless an evaluator did; the
chief's own evaluation goes to TensorBoard's eval run too), exports to `exportPath`, records the
outcome (one JSON summary, the last line on stdout and the termination log: `termination`),
and only then tells the workers and shuts every ps down.

Resumable: until the outcome is recorded nothing is torn down, so a ps lost here is recovered
and the finish is done again (the chief's `run`), and a replacement chief finds every ps still
at the last step and the workers waiting (drained) for its word. Once the outcome is in the
termination log, a ps or the chief lost is no failure of the job: the control plane reads the
recorded summary. Told to stop, it records nothing and leaves every ps serving.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxps_runtime.client.psclient import PsClient, PsClientError
from jaxps_runtime.config import cluster
from jaxps_runtime.process import termination
from jaxps_runtime.train import checkpoint, divergence, outcome, summaries
from jaxps_runtime.train.chief.checkpointer import Checkpointer
from jaxps_runtime.train.coordinator import Member, Membership
from jaxps_runtime.train.task import Task
from jaxps_runtime.train.timing import SPAN_KEYS, overlap_steps_per_second

log = logging.getLogger(__name__)


class Finish:
    """The chief's finish of a job (`run`), done again after a recovery if a ps is lost while
    finishing. The chief's main thread only. `checkpoint_error` says why the final checkpoint
    failed, if it did."""

    def __init__(
        self, task: Task, *, membership: Membership, checkpointer: Checkpointer, started: float
    ) -> None:
        self.task = task
        self.training = task.training
        self.membership = membership
        self.checkpointer = checkpointer
        self.started = started  # when the chief started, for the summary's seconds
        self.checkpoint_error: str | None = None

    def run(
        self,
        client: PsClient,
        *,
        started_from: dict[str, Any],
        recoveries: Sequence[dict[str, Any]],
    ) -> None:
        """Drains, checkpoints, evaluates and exports at the last step, then records the
        outcome, and only then tells the workers to stop and every ps to shut down."""
        training = self.training
        self._drain()
        evaluator = self.membership.member("evaluator-0")
        self.checkpointer.wait()
        rows, test = self.task.test_rows()  # dynamic tables: the held-out set's rows
        step, named = client.read(rows=rows)
        root = self.checkpointer.root
        if root is not None and step not in {m.step for m in checkpoint.committed(root)[:1]}:
            # The final checkpoint, after the workers drained (TF#32549: not before); none when
            # the last committed one is of this step (restored at or past `steps`: nothing
            # trained since, and a ps takes no Save past the last step).
            try:
                self.checkpointer.save(client, step=step, epoch=client.epoch)
            except (PsClientError, OSError, checkpoint.CheckpointError) as err:
                # The trained values are in hand: they are still evaluated, exported and
                # reported; only the checkpoint to resume from is the previous one.
                self.checkpoint_error = f"the final checkpoint (step {step}) failed: {err}"
                log.error(
                    "%s; the last committed checkpoint is step %s",
                    self.checkpoint_error,
                    self.checkpointer.last_step,
                )
        not_finite = sorted(n for n, v in named.items() if not np.isfinite(v).all())
        if not_finite:  # never "Succeeded" with a ruined model
            raise outcome.DivergedError(
                f"the final parameters of step {step} are not finite: {', '.join(not_finite)}"
            )
        members = self.membership
        first = divergence.first_loss(members.members(), workers=members.workers)
        grew = divergence.grown(first, step=step, loss=members.mean_loss())
        if grew is not None:  # nor with one that only got worse
            raise outcome.DivergedError(grew)
        if evaluator is not None and evaluator.done and evaluator.metrics:
            evaluation = dict(evaluator.metrics)  # the evaluator wrote them to TensorBoard
        else:
            evaluation = self.task.evaluate(self.task.layout.unflatten(named), test)
            evaluated = summaries.Writer(
                training.tensorboard, run=summaries.EVAL, task=self.task.name
            )
            evaluated.scalars(evaluation, step=step)
            evaluated.close()
        if training.exportPath:
            # a dynamic table is in its checkpoint, by id: not a [rows, dim] array to export
            _export(
                Path(training.exportPath),
                {n: v for n, v in named.items() if n not in self.task.dynamic},
            )
        self.task.stop.check()  # stopping: the ps tasks stay up for a replacement chief
        done = summary(
            step=step,
            evaluation=evaluation,
            members=[m for m in self.membership.members() if m.task in self.membership.workers],
            loss=self.membership.mean_loss(),
            seconds=time.monotonic() - self.started,
            started_from=started_from,
            last_checkpoint=self.checkpointer.last_step or _newest(root),
            checkpoint_error=self.checkpoint_error,
            recoveries=recoveries,
        )
        if self.task.dynamic:
            done["embeddings"] = embeddings(client.statuses())
        log.info("done: step %d, eval %s", step, done["eval"])
        line = json.dumps(done)
        termination.write([recorded(done)])  # the outcome, recorded
        print(line, flush=True)
        self._tell_stop()
        try:
            client.shutdown(reason=f"training done at step {step}")
        except PsClientError as err:  # the outcome is recorded: the control plane cleans up
            log.warning("could not shut every ps down: %s", err)

    def _drain(self) -> None:
        """Waits (a bounded time) until every live worker and the evaluator say they are done."""
        training = self.training
        waiting_for = set(
            self.membership.live_workers(
                now=time.monotonic(), timeout=training.workerTimeoutSeconds
            )
        )
        if self.task.spec.cluster.num_tasks(cluster.EVALUATOR) > 0:
            waiting_for.add("evaluator-0")
        deadline = time.monotonic() + max(60.0, 3 * training.workerTimeoutSeconds)
        while time.monotonic() < deadline:
            now = time.monotonic()
            pending = [
                m.task
                for m in self.membership.members()
                if m.task in waiting_for
                and not m.done
                and now - m.last_seen <= training.workerTimeoutSeconds
            ]
            if not pending:
                break
            self.task.stop.sleep(0.1)
        else:
            log.warning("gave up waiting for %s to finish", ", ".join(sorted(waiting_for)))

    def _tell_stop(self) -> None:
        """Tells the workers, drained and waiting, that the job is over: each heartbeat's
        reply says stop from now on. Waits (a few heartbeats at most) until every live worker
        got the word, so none is left waiting for a chief that is gone."""
        training = self.training
        self.membership.stop = True
        deadline = time.monotonic() + max(5.0, 4 * training.heartbeatSeconds)
        while time.monotonic() < deadline:
            waiting = self.membership.not_told(
                now=time.monotonic(), timeout=training.workerTimeoutSeconds
            )
            if not waiting:
                return
            self.task.stop.sleep(min(0.05, training.heartbeatSeconds))
        log.warning("%s did not hear that training is over", ", ".join(waiting))


def embeddings(statuses: Sequence[Any]) -> dict[str, dict[str, float]]:
    """Each dynamic table over every ps, from their Status counters (`table/<name>/<what>`):
    resident rows and capacity, admitted, evicted, lookups and the hit rate since the parts
    were made (Init or Restore)."""
    tables: dict[str, dict[str, float]] = {}
    for status in statuses:
        for key, value in status.counters.items():
            kind, _, rest = key.partition("/")
            name, _, what = rest.rpartition("/")
            if kind == "table" and name:
                part = tables.setdefault(name, {})
                part[what] = part.get(what, 0.0) + value
    return {
        name: {
            "resident": int(part.get("resident", 0)),
            "maxRows": int(part.get("capacity", 0)),
            "admitted": int(part.get("admitted", 0)),
            "evicted": int(part.get("evicted", 0)),
            "lookups": int(part.get("lookups", 0)),
            "hitRate": round(part["hits"] / part["lookups"], 4) if part.get("lookups") else 0.0,
        }
        for name, part in sorted(tables.items())
    }


def summary(
    *,
    step: int,
    evaluation: dict[str, float],
    members: Sequence[Member],
    loss: float,
    seconds: float,
    started_from: dict[str, Any],
    last_checkpoint: int | None,
    checkpoint_error: str | None,
    recoveries: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """The job's outcome as its summary reports it, from the workers' last heartbeats
    (`members`) and the chief's own record."""
    first_t, first, last_t, last = SPAN_KEYS
    timing = (
        {
            k: float(np.mean([m.metrics.get(k, 0.0) for m in members]))
            for k in ("pull", "compute", "push")
        }
        if members
        else {}
    )
    spans = [
        (m.metrics[first_t], m.metrics[first], m.metrics[last_t], m.metrics[last])
        for m in members
        if all(k in m.metrics for k in SPAN_KEYS)
    ]
    return {
        "event": "done",
        "step": step,
        "loss": _number(loss),
        "eval": {k: _number(v) for k, v in evaluation.items()},
        "seconds": round(seconds, 3),
        "examplesPerSecond": round(sum(m.examples_per_second for m in members), 1),
        "stepsPerSecond": round(overlap_steps_per_second(spans), 2),
        "stepSeconds": {k: round(v, 6) for k, v in timing.items()},
        "startedFrom": started_from,
        "lastCheckpointStep": last_checkpoint,
        "checkpointError": checkpoint_error,
        "recoveries": recoveries,
    }


def recorded(done: dict[str, Any], limit: int = termination.LIMIT_BYTES) -> str:
    """The summary `done` as one JSON line that the termination log keeps whole (`limit` bytes
    with its line break): the control plane reads the job's outcome there, and a cut line is
    no summary. A long history is shortened: the dynamic tables with the fewest resident
    rows first (`embeddingsLeftOut` counts them), then the oldest recoveries
    (`recoveriesLeftOut`), then evaluation metrics past those that fit (`evalLeftOut`), then a
    long checkpoint error; stdout keeps the whole summary."""
    fitted = dict(done)

    def fits() -> bool:
        return len(json.dumps(fitted).encode()) < limit

    tables = dict(fitted.get("embeddings") or {})
    by_size = sorted(tables, key=lambda name: (tables[name].get("resident", 0), name))
    while by_size and not fits():
        del tables[by_size.pop(0)]
        fitted["embeddings"] = tables
        fitted["embeddingsLeftOut"] = len(done["embeddings"]) - len(tables)

    recoveries = list(fitted.get("recoveries") or [])
    while recoveries and not fits():
        recoveries.pop(0)
        fitted["recoveries"] = recoveries
        fitted["recoveriesLeftOut"] = len(done["recoveries"]) - len(recoveries)
    evaluation = dict(fitted.get("eval") or {})
    while evaluation and not fits():
        evaluation.popitem()
        fitted["eval"] = evaluation
        fitted["evalLeftOut"] = len(done["eval"]) - len(evaluation)
    error = fitted.get("checkpointError")
    if isinstance(error, str) and not fits():
        fitted["checkpointError"] = error[: max(0, limit // 4)] + "..."
    return json.dumps(fitted)


def _newest(root: Path | None) -> int | None:
    """The step of the newest committed checkpoint in `root` (one this chief restored)."""
    found = checkpoint.committed(root) if root is not None else []
    return found[0].step if found else None


def _number(value: float) -> float | None:
    """JSON has no NaN or infinity: a diverged loss is reported as null."""
    return round(value, 6) if math.isfinite(value) else None


def _export(path: Path, named: dict[str, np.ndarray]) -> None:
    """Writes the parameters by leaf name, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as out:
        np.savez(out, **named)  # type: ignore[arg-type]
    partial.replace(path)
    log.info("wrote the parameters to %s", path)
