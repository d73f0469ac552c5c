"""The evaluator: every `evalEverySteps` global steps, pulls the parameters and evaluates them
on the held-out data; exports the metrics (Prometheus `jaxps_eval{metric=...}`) and reports
them to the chief, which uses the final ones in its summary; with `training.tensorboard`, also
writes them to TensorBoard event files under `<dir>/eval`, at the step evaluated (`summaries`).
Told to stop (`stopping`), it ends its pull (which may be waiting for a step) and exits with
`stopping.Stopped`; its event files are closed whichever way it ends.
"""

from __future__ import annotations

import logging

from jaxps_runtime.client.psclient import PsClientError
from jaxps_runtime.train import summaries
from jaxps_runtime.train.task import Task

log = logging.getLogger(__name__)


def run(task: Task) -> int:
    training = task.training
    client = task.ps_client()
    coordinator = task.coordinator()
    tensorboard = summaries.Writer(training.tensorboard, run=summaries.EVAL, task=task.name)
    try:
        coordinator.register(timeout=training.startupTimeoutSeconds)
        step = client.wait_ready(timeout=training.startupTimeoutSeconds)
        every = training.evalEverySteps
        rows, test = task.test_rows()
        while True:
            task.stop.check()
            target = min(training.steps, (step // every + 1) * every)
            try:
                step, named = client.read(min_step=target, rows=rows)
            except PsClientError as err:
                log.warning("%s; waiting for the ps tier to be ready again", err)
                client.incarnations = [0] * len(client.incarnations)
                step = client.wait_ready(timeout=training.startupTimeoutSeconds)
                continue
            results = task.evaluate(task.layout.unflatten(named), test)
            task.metrics.set_eval(results)
            task.metrics.global_step.set(step)
            tensorboard.scalars(results, step=step)
            log.info("step %d: %s", step, "  ".join(f"{k} {v:.4f}" for k, v in results.items()))
            done = step >= training.steps
            state = coordinator.heartbeat(
                step=step, loss=results.get("loss", float("nan")), metrics=results, done=done
            )
            if done or (state is not None and state.stop and step >= training.steps):
                return 0
    finally:
        tensorboard.close()
        coordinator.close()
        client.close()
