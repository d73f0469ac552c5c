"""The chief (or worker 0 when the job has no chief): coordinates a job from start to end.

1. Serves the Coordinator service on its own address, so tasks can register and heartbeat.
2. Waits for every ps, logging which task at which address it waits for (research pitfall 2).
3. Initialises the variables from the seed, with the mode and the workers, at epoch 1.
4. Watches: logs step, loss and steps per second; a worker silent for `workerTimeoutSeconds` is
   dropped from the live set the ps tasks aggregate over (sync never hangs on a dead worker).
5. At `steps`: tells every task to stop, waits for the workers and the evaluator to finish,
   evaluates (unless an evaluator did), writes the parameters to `exportPath` if set, shuts every
   ps down so none lingers, and prints one JSON summary as its last line on stdout (also to
   /dev/termination-log when that file exists, as Kubernetes reads it).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime import cluster, rpc, server
from jaxps_runtime.client import PsClient
from jaxps_runtime.config import TrainingConfig
from jaxps_runtime.coordinator import CoordinatorServicer, Membership
from jaxps_runtime.shards import Mode
from jaxps_runtime.task import Task
from jaxps_runtime.worker import Worker

log = logging.getLogger(__name__)
TERMINATION_LOG = Path("/dev/termination-log")
EPOCH = 1

_MODES = {"sync": ps_pb2.SYNC, "async": ps_pb2.ASYNC, "boundedStaleness": ps_pb2.BOUNDED_STALENESS}


def ps_mode(training: TrainingConfig) -> Mode:
    return Mode(
        kind=_MODES[training.mode],
        replicas_to_aggregate=training.replicasToAggregate or 0,
        max_staleness=training.staleness,
        last_step=training.steps,
    )


class Chief:
    """Runs a job's coordination; with `trains`, also worker 0's training loop."""

    def __init__(self, task: Task, *, trains: bool, bind: str | None = None) -> None:
        self.task = task
        self.trains = trains
        self.training = task.training
        self.membership = Membership(
            job_id=task.job_id, workers=task.worker_names, now=time.monotonic()
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(16, thread_name_prefix="coordinator"),
            options=list(rpc.SERVER_OPTIONS),
        )
        self._server.add_generic_rpc_handlers(
            (rpc.COORDINATOR.generic_handler(CoordinatorServicer(self.membership, task=task.name)),)
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        where = server.bind_address(task.chief_address, override=bind)
        if not self._server.add_insecure_port(where):
            raise server.BindError(f"{task.name}: cannot listen on {where}")
        self.started = time.monotonic()

    def run(self) -> int:
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        client = self.task.ps_client()
        worker_result: list[int] = []
        worker_thread: threading.Thread | None = None
        try:
            self._initialise(client)
            if self.trains:
                worker_thread = threading.Thread(
                    target=lambda: worker_result.append(self._train()), name="worker-0"
                )
                worker_thread.start()
            code = self._watch(client)
            if worker_thread is not None:
                worker_thread.join()
                if worker_result != [0]:
                    code = code or 1
            if code == 0:
                self._finish(client)
            else:
                client.shutdown(reason="the chief failed")
            return code
        finally:
            client.close()
            self._server.stop(2).wait()

    def _train(self) -> int:
        try:
            return Worker(self.task).run()
        except Exception:
            log.exception("worker-0 failed")
            return 1

    def _initialise(self, client: PsClient) -> None:
        training = self.training
        log.info(
            "waiting for %d ps: %s",
            len(client.addresses),
            ", ".join(f"ps-{i} at {a}" for i, a in enumerate(client.addresses)),
        )
        client.wait_reachable(timeout=training.startupTimeoutSeconds)
        params = self.task.initial_params()
        client.init(
            params,
            optimizer=training.optimizer,
            epoch=EPOCH,
            mode=ps_mode(training),
            workers=self.task.worker_names,
        )
        self.membership.epoch = EPOCH
        nbytes = sum(v.nbytes for v in params.values())
        log.info(
            "initialised %d variables (%.1f MB) from seed %d on %d ps; %s mode, %d steps",
            len(params),
            nbytes / 1e6,
            training.seed,
            len(client.addresses),
            training.mode,
            training.steps,
        )
        if training.checkpoint.dir:
            log.warning(
                "checkpoint.dir is set but checkpoints are not implemented yet; nothing is saved"
            )

    def _watch(self, client: PsClient) -> int:
        """Until the global step reaches `steps`; returns 0, or 1 if every worker is gone."""
        training, metrics = self.training, self.task.metrics
        live = list(self.task.worker_names)
        last_log, last_step, last_time = time.monotonic(), 0, time.monotonic()
        while True:
            step = min(client.steps())
            now = time.monotonic()
            self.membership.step = step
            metrics.global_step.set(step)
            loss = self.membership.mean_loss()
            if not math.isnan(loss):
                metrics.loss.set(loss)
            metrics.examples_per_second.set(
                sum(
                    m.examples_per_second
                    for m in self.membership.members()
                    if m.task in self.membership.workers
                )
            )
            if step >= training.steps:
                return 0
            alive = self.membership.live_workers(now=now, timeout=training.workerTimeoutSeconds)
            if alive != live:
                gone, back = set(live) - set(alive), set(alive) - set(live)
                if gone:
                    log.warning(
                        "%s sent no heartbeat for %.0f s: continuing without",
                        ", ".join(sorted(gone)),
                        training.workerTimeoutSeconds,
                    )
                if back:
                    log.info("%s is back", ", ".join(sorted(back)))
                if not alive:
                    log.error(
                        "every worker is gone (no heartbeat for %.0f s); giving up at step %d",
                        training.workerTimeoutSeconds,
                        step,
                    )
                    return 1
                client.set_workers(alive)
                live = alive
            if now - last_log >= training.logEverySeconds:
                rate = (step - last_step) / (now - last_time)
                metrics.steps_per_second.set(rate)
                log.info("step %d/%d  loss %.4f  %.1f steps/s", step, training.steps, loss, rate)
                last_log, last_step, last_time = now, step, now
            time.sleep(min(0.2, training.heartbeatSeconds))

    def _finish(self, client: PsClient) -> None:
        training = self.training
        self.membership.stop = True
        has_evaluator = self.task.spec.cluster.num_tasks(cluster.EVALUATOR) > 0
        waiting_for = set(
            self.membership.live_workers(
                now=time.monotonic(), timeout=training.workerTimeoutSeconds
            )
        )
        if has_evaluator:
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
            time.sleep(0.1)
        else:
            log.warning("gave up waiting for %s to finish", ", ".join(sorted(waiting_for)))
        evaluator = self.membership.member("evaluator-0")
        step, named = client.pull()
        if evaluator is not None and evaluator.done and evaluator.metrics:
            evaluation = dict(evaluator.metrics)
        else:
            evaluation = self.task.evaluate(self.task.layout.unflatten(named))
        if training.exportPath:
            _export(Path(training.exportPath), named)
        client.shutdown(reason=f"training done at step {step}")
        self._summary(step=step, evaluation=evaluation)

    def _summary(self, *, step: int, evaluation: dict[str, float]) -> None:
        members = [m for m in self.membership.members() if m.task in self.task.worker_names]
        timing = (
            {
                k: float(np.mean([m.metrics.get(k, 0.0) for m in members]))
                for k in ("pull", "compute", "push")
            }
            if members
            else {}
        )
        summary: dict[str, Any] = {
            "event": "done",
            "step": step,
            "loss": _number(self.membership.mean_loss()),
            "eval": {k: _number(v) for k, v in evaluation.items()},
            "seconds": round(time.monotonic() - self.started, 3),
            "examplesPerSecond": round(sum(m.examples_per_second for m in members), 1),
            "stepSeconds": {k: round(v, 6) for k, v in timing.items()},
        }
        log.info("done: step %d, eval %s", step, summary["eval"])
        line = json.dumps(summary)
        if TERMINATION_LOG.exists():
            try:
                TERMINATION_LOG.write_text(line + "\n")
            except OSError as err:
                log.warning("cannot write %s: %s", TERMINATION_LOG, err)
        print(line, flush=True)


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
