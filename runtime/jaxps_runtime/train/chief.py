"""The chief (or worker 0 when the job has no chief): coordinates a job from start to end.

1. Serves the Coordinator service on its own address, so tasks can register and heartbeat.
2. Waits for every ps, logging which task at which address it waits for (research pitfall 2).
3. Initialises the variables from the seed, with the mode and the workers, at epoch 1.
4. Watches: logs step, loss and steps per second (and, with `training.tensorboard`, writes them
   with examples per second and the pull/compute/push split of a step to TensorBoard event
   files: `summaries`); a worker silent for `workerTimeoutSeconds` is dropped from the live set
   the ps tasks aggregate over (sync never hangs on a dead worker).
5. At `steps`: tells every task to stop, waits for the workers and the evaluator to finish,
   evaluates (unless an evaluator did; the chief's own evaluation goes to TensorBoard's eval
   run too), writes the parameters to `exportPath` if set, shuts every ps down so none lingers,
   and prints one JSON summary as its last line on stdout (also to the termination log when
   that file exists, as Kubernetes reads it: `termination`).
Told to stop (SIGTERM, `stopping`), it ends its waits and calls and exits with
`stopping.Stopped`, leaving the ps tasks serving (never Shutdown: a replacement chief adopts
their state) and committing no checkpoint it has not got every shard of.
"""

from __future__ import annotations

import dataclasses
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
from jaxps_runtime.client.psclient import PsClient, PsClientError, PsRestartedError
from jaxps_runtime.config import cluster
from jaxps_runtime.config.training import TrainingConfig
from jaxps_runtime.process import stopping, termination
from jaxps_runtime.ps import server
from jaxps_runtime.train import checkpoint, outcome, recovery, summaries, watch
from jaxps_runtime.train.coordinator import CoordinatorServicer, Member, Membership
from jaxps_runtime.train.task import Task
from jaxps_runtime.train.worker import (
    DIVERGED_BATCH,
    DIVERGED_EPOCH,
    DIVERGED_STEP,
    SPAN_KEYS,
    Worker,
    overlap_steps_per_second,
)
from jaxps_runtime.wire import rpc
from jaxps_runtime.wire.terms import Mode

log = logging.getLogger(__name__)

_MODES = {"sync": ps_pb2.SYNC, "async": ps_pb2.ASYNC, "boundedStaleness": ps_pb2.BOUNDED_STALENESS}
# How a ps that went away answers (or rather, does not).
_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def ps_mode(training: TrainingConfig) -> Mode:
    return Mode(
        kind=_MODES[training.mode],
        replicas_to_aggregate=training.replicasToAggregate or 0,
        max_staleness=training.staleness,
        last_step=training.steps,
    )


class Checkpointer:
    """The chief's checkpoints: periodic ones in a background thread, one at a time, and the
    final one. A checkpoint that fails (a ps died while writing) is simply not committed."""

    def __init__(self, task: Task) -> None:
        self.task = task
        config = task.training.checkpoint
        self.root = Path(config.dir) if config.dir else None
        self.every_steps = config.everySteps
        # TensorFlow's CheckpointSaverHook default when neither is given: every 600 s.
        self.every_seconds = config.everySeconds or (None if config.everySteps else 600.0)
        self.last_step: int | None = None
        self._thread: threading.Thread | None = None
        self._stop: stopping.Stop | None = None

    @property
    def busy(self) -> bool:
        """Whether a periodic checkpoint is being written (one at a time)."""
        return self._thread is not None and self._thread.is_alive()

    def policy(self, *, steps: int) -> watch.Policy:
        """When periodic checkpoints are due (`watch.checkpoint_target`)."""
        return watch.Policy(
            steps=steps,
            checkpoints=self.root is not None,
            every_steps=self.every_steps,
            every_seconds=self.every_seconds,
        )

    def start(self, *, step: int, epoch: int, incarnations: list[int]) -> None:
        # Its own stop, set by the task's or by `abandon`: a Save waiting for a step that
        # never comes would otherwise hold the process at exit (its pool's threads are joined).
        stop = self._stop = stopping.Stop()
        unlink = self.task.stop.callback(stop.request)

        def run() -> None:
            client = self.task.ps_client(stop=stop)
            client.epoch, client.incarnations = epoch, list(incarnations)
            try:
                self.save(client, step=step, epoch=epoch)
            except (PsClientError, OSError, checkpoint.CheckpointError) as err:
                log.warning("checkpoint of step %d not committed: %s", step, err)
            except stopping.Stopped as stopped:
                log.info("checkpoint of step %d not committed: %s", step, stopped)
            finally:
                client.close()
                unlink()

        self._thread = threading.Thread(target=run, name="checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def abandon(self) -> None:
        """Ends the periodic checkpoint in flight, uncommitted (the chief is going)."""
        if self.busy and self._stop is not None:
            self._stop.request()
            self.wait()

    def save(self, client: PsClient, *, step: int, epoch: int) -> None:
        assert self.root is not None
        training = self.task.training
        started = time.monotonic()
        manifest = checkpoint.save(
            client,
            root=self.root,
            step=step,
            epoch=epoch,
            placement=self.task.placement.to_dict(),
            optimizer=training.optimizer.to_json(),
            mode=training.mode,
            keep=training.checkpoint.keep,
            timeout=max(120.0, 10 * training.workerTimeoutSeconds),
        )
        self.last_step = step
        self.task.metrics.last_checkpoint_step.set(step)
        size = sum(r.bytes for r in manifest.shards)
        log.info(
            "checkpoint of step %d committed (%.1f MB in %.2f s)",
            step,
            size / 1e6,
            time.monotonic() - started,
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
        guard = rpc.guard(task.spec.cluster, job=task.job_id, credentials=task.credentials)
        servicer = CoordinatorServicer(self.membership, task=task.name)
        self._server.add_generic_rpc_handlers(
            (rpc.COORDINATOR.generic_handler(servicer, guard=guard),)
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        where = server.bind_address(task.chief_address, override=bind)
        if not rpc.add_port(self._server, where, task.credentials):
            raise server.BindError(f"{task.name}: cannot listen on {where}")
        self.started = time.monotonic()
        self.checkpointer = Checkpointer(task)
        self.recoveries: list[dict[str, Any]] = []
        self.checkpoint_error: str | None = None
        self.started_from: dict[str, Any] = {}
        self.last_checkpoint: int | None = None
        # Last: its thread starts here, and `run` closes it.
        self.tensorboard = summaries.Writer(
            self.training.tensorboard, run=summaries.TRAIN, task=task.name
        )
        self._recorded: int | None = None  # the step of the last TensorBoard point
        self._worker_error: BaseException | None = None  # how worker 0's thread failed
        self.rollbacks = 0  # on divergence (training.onDivergence: rollback)
        self._seen: tuple[watch.PsSeen, ...] = ()  # the last look at the ps tier

    def run(self) -> int:
        """Coordinates the job to its end: 0 once its outcome is recorded (the summary in the
        termination log) and the ps tasks are told to shut down.

        Every ps is told to shut down only then. On any failure before (the chief's own, or a
        cause that ends the job: `outcome.JobFailure`), the ps tasks stay serving: a
        replacement chief adopts them, or the control plane removes them as the job ends. A
        ps lost while finishing is recovered like one lost while training, and the finish is
        done again (`_finish` is resumable, by this chief or by its replacement)."""
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.task.metrics.ready.set()
        client = self.task.ps_client()
        worker_thread: threading.Thread | None = None
        try:
            self._initialise(client)
            if self.trains:
                # A daemon: if the chief fails, the process exits instead of waiting for it.
                worker_thread = threading.Thread(target=self._train, name="worker-0", daemon=True)
                worker_thread.start()
            while True:
                code = self._watch(client)
                if code != 0:
                    log.error("the chief failed: leaving every ps serving for a replacement")
                    return code
                try:
                    self._finish(client)
                    break
                except PsClientError as err:
                    if err.code not in _GONE and not isinstance(err, PsRestartedError):
                        raise
                    log.warning("%s while finishing: recovering, then finishing again", err)
            if worker_thread is not None:
                worker_thread.join()
                self._worker_failed()
            return 0
        finally:
            self.task.metrics.training.set(0)
            self.checkpointer.abandon()
            if worker_thread is not None and self.task.stop.is_set:
                worker_thread.join(timeout=stopping.PUSH_GRACE_SECONDS + 1)
            self.task.metrics.ready.clear()
            self.tensorboard.close()
            client.close()
            self._server.stop(2).wait()

    def _train(self) -> None:
        """Worker 0's loop in its thread; how it ended is kept for the chief (`_worker_failed`)."""
        try:
            Worker(self.task).run()
        except stopping.Stopped:
            pass
        except outcome.JobFailure as err:
            self._worker_error = err  # the chief reports it
        except BaseException as err:
            log.exception("worker-0 failed")
            self._worker_error = err

    def _worker_failed(self) -> None:
        """Raises what ended worker 0's thread, if it failed: a cause that ends the job as it
        is, anything else as a failure of the chief (the process is both)."""
        err = self._worker_error
        if err is None:
            return
        if isinstance(err, outcome.JobFailure):
            raise err
        raise RuntimeError(f"worker-0 failed: {type(err).__name__}: {err}") from err

    def _initialise(self, client: PsClient) -> None:
        training = self.training
        log.info(
            "waiting for %d ps: %s",
            len(client.addresses),
            ", ".join(f"ps-{i} at {a}" for i, a in enumerate(client.addresses)),
        )
        client.wait_reachable(timeout=training.startupTimeoutSeconds)
        ready = recovery.bring_up(
            client, self.task, mode=ps_mode(training), workers=self.task.worker_names, adopt=True
        )
        self._adopt(ready)
        self.membership.watching_from(time.monotonic())
        self.started_from = {"how": ready.how, "step": ready.step}
        log.info(
            "%s at step %d (epoch %d); %s mode, %d steps, checkpoints %s",
            ready.how,
            ready.step,
            ready.epoch,
            training.mode,
            training.steps,
            training.checkpoint.dir or "off",
        )

    def _adopt(self, ready: recovery.Ready) -> None:
        self.membership.epoch = ready.epoch
        self.membership.step = ready.step
        if ready.how == "restored":
            self.last_checkpoint = ready.step
            self.task.metrics.last_checkpoint_step.set(ready.step)
        if ready.how != "adopted":  # a rollback (or a fresh start): later points are void
            self.tensorboard.restarted(step=ready.step)
        self._recorded = ready.step  # the next point once training moves on from here

    def _recover(self, client: PsClient, problem: str) -> None:
        """Rolls every ps back to the last committed checkpoint, at a new epoch."""
        started, before = time.monotonic(), self.membership.step
        log.warning("%s: rolling every ps back to the last committed checkpoint", problem)
        # No waiting for a checkpoint in flight: the Init below aborts its pending Saves, and
        # `checkpoint.save` never commits one whose replies are not all from its epoch.
        deadline = started + self.training.startupTimeoutSeconds
        while True:
            client.wait_reachable(timeout=max(deadline - time.monotonic(), 0.0))
            live = self.membership.live_workers(
                now=time.monotonic(), timeout=self.training.workerTimeoutSeconds
            ) or list(self.task.worker_names)
            try:
                ready = recovery.bring_up(
                    client,
                    self.task,
                    mode=ps_mode(self.training),
                    workers=live,
                    adopt=False,
                    epoch_floor=max(self.membership.epoch, client.epoch),
                )
                break
            except PsClientError as err:
                # A ps went away again mid-rollback (it crashed, or was stopped as it came
                # back): wait for it again and roll back at a newer epoch than any half-done one.
                if err.code not in _GONE and not isinstance(err, PsRestartedError):
                    raise
                log.warning("%s; rolling back again once every ps answers", err)
        self._adopt(ready)
        seconds = time.monotonic() - started
        self.recoveries.append(
            {
                "reason": problem,
                "fromStep": before,
                "toStep": ready.step,
                "seconds": round(seconds, 3),
            }
        )
        log.warning(
            "recovered in %.1f s: %s at step %d (from step %d), epoch %d",
            seconds,
            ready.how,
            ready.step,
            before,
            ready.epoch,
        )

    def _observe(self, client: PsClient) -> watch.Observation:
        """One look: one Status per ps (the step comes from the same replies that say the tier
        is healthy: a second call could meet a ps that died in between, uncaught), and which
        workers were heard from."""
        try:
            seen = tuple(watch.PsSeen.of(s) for s in client.statuses(timeout=10))
            unreachable = ""
        except PsClientError as err:
            seen, unreachable = (), str(err)
        now = time.monotonic()
        alive = self.membership.live_workers(now=now, timeout=self.training.workerTimeoutSeconds)
        if seen:
            self._seen = seen
        return watch.Observation(
            now=now,
            ps=seen,
            unreachable=unreachable,
            alive=tuple(alive),
            checkpointing=self.checkpointer.busy,
        )

    def _watch(self, client: PsClient) -> int:
        """Until the global step reaches `steps`; returns 0, or 1 if every worker is gone. The
        decisions are `watch.decide`'s; this carries them out. Raises `outcome.StalledError`
        when the step has not moved for `progressTimeoutSeconds` while training (the clock
        starts again after every start, rollback and checkpoint), `outcome.DivergedError`
        past `maxRollbacks`, and what ended worker 0's thread."""
        training = self.training
        policy = self.checkpointer.policy(steps=training.steps)
        state = watch.State(
            epoch=client.epoch,
            incarnations=tuple(client.incarnations),
            live=tuple(self.task.worker_names),
            last_checkpoint_time=time.monotonic(),
        )
        last_log, last_step, last_time = time.monotonic(), self.membership.step, time.monotonic()
        moved = (self.membership.step, time.monotonic())  # the step, and since when
        self.task.metrics.training.set(1)
        while True:
            if self._worker_error is not None:
                self._worker_failed()
            observation = self._observe(client)
            state, actions = watch.decide(policy, state, observation)
            now, step, loss = observation.now, self.membership.step, math.nan
            diverged = self._divergence()
            if diverged and not any(isinstance(a, watch.Recover | watch.Stop) for a in actions):
                actions = [watch.Recover(diverged)]
            for action in actions:
                match action:
                    case watch.Recover(reason=reason):
                        self.task.metrics.training.set(0)
                        if reason is diverged:
                            self._roll_back_divergence(reason)
                        self._recover(client, reason)
                        state = dataclasses.replace(
                            state, epoch=client.epoch, incarnations=tuple(client.incarnations)
                        )
                        moved = (self.membership.step, time.monotonic())
                        self.task.metrics.training.set(1)
                    case watch.Progress(step=step):
                        loss = self._progress(step)
                    case watch.Stop(step=step):  # the curves end at the last step
                        self._record(
                            step=step, loss=loss, rate=_rate(step, last_step, now - last_time)
                        )
                        self.task.metrics.training.set(0)
                        return 0
                    case watch.Checkpoint(step=target):
                        self.checkpointer.start(
                            step=target, epoch=client.epoch, incarnations=client.incarnations
                        )
                    case watch.SetWorkers(workers=workers, gone=gone, back=back):
                        if gone:
                            log.warning(
                                "%s sent no heartbeat for %.0f s: continuing without",
                                ", ".join(sorted(gone)),
                                training.workerTimeoutSeconds,
                            )
                        if back:
                            log.info("%s is back", ", ".join(sorted(back)))
                        client.set_workers(list(workers))
                    case watch.GiveUp(reason=reason):
                        log.error(
                            "%s (no heartbeat for %.0f s)", reason, training.workerTimeoutSeconds
                        )
                        return 1
            if any(isinstance(action, watch.Recover) for action in actions):
                continue
            if step != moved[0] or self.checkpointer.busy:
                moved = (step, now)
            elif 0 < training.progressTimeoutSeconds <= now - moved[1]:
                raise outcome.StalledError(self._stall_report(step, seconds=now - moved[1]))
            if self._summary_due(step):
                self._record(step=step, loss=loss, rate=_rate(step, last_step, now - last_time))
            if now - last_log >= training.logEverySeconds:
                rate = _rate(step, last_step, now - last_time)
                self.task.metrics.steps_per_second.set(rate)
                shown = f"{loss:.4f}" if step > 0 else "-"  # no loss before the first step
                log.info("step %d/%d  loss %s  %.1f steps/s", step, training.steps, shown, rate)
                last_log, last_step, last_time = now, step, now
            self.task.stop.sleep(min(0.2, training.heartbeatSeconds))

    def _divergence(self) -> str | None:
        """A worker's report of a divergence at the current epoch (onDivergence: rollback),
        as the reason of the rollback it asks for; None without one."""
        for m in self.membership.members():
            if m.task not in self.membership.workers or DIVERGED_EPOCH not in m.metrics:
                continue
            if int(m.metrics[DIVERGED_EPOCH]) == self.membership.epoch:
                return (
                    f"{m.task} diverged at global step {int(m.metrics.get(DIVERGED_STEP, 0))} "
                    f"(batch {int(m.metrics.get(DIVERGED_BATCH, 0))} of its data shard)"
                )
        return None

    def _roll_back_divergence(self, reason: str) -> None:
        """Counts a rollback on divergence; `outcome.DivergedError` past `maxRollbacks`."""
        self.rollbacks += 1
        limit = self.training.maxRollbacks
        if self.rollbacks > limit:
            raise outcome.DivergedError(
                f"{reason}, and training.maxRollbacks ({limit}) rollbacks are used up; lower "
                "the learning rate"
            )
        log.error(
            "%s: rollback %d of at most %d, skipping that batch", reason, self.rollbacks, limit
        )

    def _stall_report(self, step: int, *, seconds: float) -> str:
        """Why the step stands still, as each task last said: what each worker and the
        evaluator waits for, and where each ps is."""
        now = time.monotonic()
        parts = []
        for m in sorted(self.membership.members(), key=lambda m: m.task):
            heard = now - m.last_seen
            doing = f"waits for {m.waiting}" if m.waiting else "has said nothing yet"
            if m.done:
                doing = "is done"
            parts.append(f"{m.task} {doing} (at step {m.step}, last heard {heard:.0f} s ago)")
        for i, ps in enumerate(self._seen):
            parts.append(
                f"ps-{i} is {ps_pb2.PsState.Name(ps.state)} at step {ps.step} (epoch {ps.epoch})"
            )
        return (
            f"the global step has not moved from {step} for {seconds:.0f} s "
            f"(training.progressTimeoutSeconds: {self.training.progressTimeoutSeconds:g}): "
            + "; ".join(parts)
        )

    def _summary_due(self, step: int) -> bool:
        """Whether the step crossed a multiple of `summaryEverySteps` since the last point."""
        every = self.training.summaryEverySteps
        last = self._recorded if self._recorded is not None else 0
        return step > last and step // every > last // every

    def _progress(self, step: int) -> float:
        """Publishes the global step, the workers' mean loss (returned) and their examples per
        second."""
        metrics = self.task.metrics
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
        return loss

    def _record(self, *, step: int, loss: float, rate: float) -> None:
        """One log tick's TensorBoard scalars (`summaries`), with the global step; none while
        the step stands still (compiling, waiting for a worker): one point per step."""
        if step == self._recorded:
            return
        self._recorded = step
        workers = [m for m in self.membership.members() if m.task in self.membership.workers]
        values = {
            summaries.STEPS_PER_SECOND: rate,
            summaries.EXAMPLES_PER_SECOND: sum(m.examples_per_second for m in workers),
            **summaries.step_seconds(_mean_split(workers)),
        }
        if not math.isnan(loss):  # no loss before the first step
            values[summaries.LOSS] = loss
        self.tensorboard.scalars(values, step=step)

    def _finish(self, client: PsClient) -> None:
        """Drains, checkpoints, evaluates and exports at the last step, then records the
        outcome, and only then tells the workers to stop and every ps to shut down.

        Resumable: until the outcome is recorded nothing is torn down, so a ps lost here is
        recovered and the finish is done again (`run`), and a replacement chief finds every
        ps still at the last step and the workers waiting (drained) for its word. Once the
        outcome is in the termination log, a ps or the chief lost is no failure of the job:
        the control plane reads the recorded summary."""
        training = self.training
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
            self.task.stop.sleep(0.1)
        else:
            log.warning("gave up waiting for %s to finish", ", ".join(sorted(waiting_for)))
        evaluator = self.membership.member("evaluator-0")
        self.checkpointer.wait()
        step, named = client.read()
        if self.checkpointer.root is not None:
            # The final checkpoint, after the workers drained (TF#32549: not before).
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
        if evaluator is not None and evaluator.done and evaluator.metrics:
            evaluation = dict(evaluator.metrics)  # the evaluator wrote them to TensorBoard
        else:
            evaluation = self.task.evaluate(self.task.layout.unflatten(named))
            evaluated = summaries.Writer(
                training.tensorboard, run=summaries.EVAL, task=self.task.name
            )
            evaluated.scalars(evaluation, step=step)
            evaluated.close()
        if training.exportPath:
            _export(Path(training.exportPath), named)
        self.task.stop.check()  # stopping: the ps tasks stay up for a replacement chief
        self._summary(step=step, evaluation=evaluation)  # the outcome, recorded
        self._tell_stop()
        try:
            client.shutdown(reason=f"training done at step {step}")
        except PsClientError as err:  # the outcome is recorded: the control plane cleans up
            log.warning("could not shut every ps down: %s", err)

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

    def _summary(self, *, step: int, evaluation: dict[str, float]) -> None:
        first_t, first, last_t, last = SPAN_KEYS
        members = [m for m in self.membership.members() if m.task in self.task.worker_names]
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
        summary: dict[str, Any] = {
            "event": "done",
            "step": step,
            "loss": _number(self.membership.mean_loss()),
            "eval": {k: _number(v) for k, v in evaluation.items()},
            "seconds": round(time.monotonic() - self.started, 3),
            "examplesPerSecond": round(sum(m.examples_per_second for m in members), 1),
            "stepsPerSecond": round(overlap_steps_per_second(spans), 2),
            "stepSeconds": {k: round(v, 6) for k, v in timing.items()},
            "startedFrom": self.started_from,
            "lastCheckpointStep": self.checkpointer.last_step,
            "checkpointError": self.checkpoint_error,
            "recoveries": self.recoveries,
        }
        log.info("done: step %d, eval %s", step, summary["eval"])
        line = json.dumps(summary)
        termination.write([line])
        print(line, flush=True)


def _rate(step: int, last_step: int, seconds: float) -> float:
    """Global steps per second over a window; a rollback moves the step back: no negative
    rate for the window it spans."""
    return max(step - last_step, 0) / seconds if seconds > 0 else 0.0


def _mean_split(members: list[Member]) -> dict[str, float]:
    """The mean {pull, compute, push} seconds of a step over the workers that timed one (until
    its first warm step, a worker reports 0 s for each)."""
    phases = ("pull", "compute", "push")
    timed = [m.metrics for m in members if sum(m.metrics.get(p, 0.0) for p in phases) > 0]
    return {p: sum(t.get(p, 0.0) for t in timed) / len(timed) for p in phases} if timed else {}


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
