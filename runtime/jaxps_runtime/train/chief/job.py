"""The chief's run of a job: serves the Coordinator service, brings the ps tier up and watches
training (`coordination`), finishes at the last step (`finish`); in a job without a chief task,
also runs worker 0's training loop in a thread (`WorkerZero`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxps_runtime.client.psclient import PsClientError
from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.process import stopping
from jaxps_runtime.ps import server
from jaxps_runtime.train import outcome
from jaxps_runtime.train.chief import preemption
from jaxps_runtime.train.chief.checkpointer import Checkpointer
from jaxps_runtime.train.chief.coordination import Coordination, ps_gone
from jaxps_runtime.train.chief.finish import Finish
from jaxps_runtime.train.chief.progress import Progress
from jaxps_runtime.train.coordinator import CoordinatorServicer, Membership
from jaxps_runtime.train.shardqueue import ShardQueue
from jaxps_runtime.train.task import Task
from jaxps_runtime.train.worker import Worker
from jaxps_runtime.wire import rpc

log = logging.getLogger(__name__)


class WorkerZeroLike(Protocol):
    """Worker 0's loop as the chief's run sees it: started once the ps tier is up, checked for a
    failure while it watches, joined at the end."""

    def start(self) -> None: ...

    def check(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class WorkerZero:
    """Worker 0's training loop in a daemon thread of the chief's process (a job without a
    chief task): if the chief fails, the process exits instead of waiting for it. How the loop
    ended is kept for the chief (`check`)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._train, name="worker-0", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Waits for the loop to end (at once if it never started)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def check(self) -> None:
        """Raises what ended worker 0's thread, if it failed: a cause that ends the job as it
        is, anything else as a failure of the chief (the process is both)."""
        err = self._error
        if err is None:
            return
        if isinstance(err, outcome.JobFailure):
            raise err
        raise RuntimeError(f"worker-0 failed: {type(err).__name__}: {err}") from err

    def _train(self) -> None:
        try:
            Worker(self.task).run()
        except stopping.Stopped:
            pass
        except outcome.JobFailure as err:
            self._error = err  # the chief reports it
        except BaseException as err:
            log.exception("worker-0 failed")
            self._error = err


class Chief:
    """Runs a job's coordination; with `trains`, also worker 0's training loop."""

    def __init__(
        self,
        task: Task,
        *,
        trains: bool,
        bind: str | None = None,
        worker_zero: WorkerZeroLike | None = None,
    ) -> None:
        self.task = task
        self.membership = Membership(
            job_id=task.job_id, workers=task.worker_names, now=time.monotonic()
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(16, thread_name_prefix="coordinator"),
            options=list(rpc.SERVER_OPTIONS),
        )
        guard = rpc.guard(task.spec.cluster, job=task.job_id, credentials=task.credentials)
        self.queue = ShardQueue(
            ShardPlan.of(task.dataset, batch_size=task.training.batchSize, seed=task.training.seed)
        )
        servicer = CoordinatorServicer(self.membership, task=task.name, queue=self.queue)
        self._server.add_generic_rpc_handlers(
            (rpc.COORDINATOR.generic_handler(servicer, guard=guard),)
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        where = server.bind_address(task.chief_address, override=bind)
        if not rpc.add_port(self._server, where, task.credentials):
            raise server.BindError(f"{task.name}: cannot listen on {where}")
        preempt_seconds = preemption.seconds(os.environ)
        checkpointer = self.checkpointer = Checkpointer(task, keep_on_sigterm=preempt_seconds > 0)
        self.preemption = preemption.Preemption(
            task, checkpointer=checkpointer, seconds=preempt_seconds
        )
        self.preemption.hold()
        self.finish = Finish(
            task, membership=self.membership, checkpointer=checkpointer, started=time.monotonic()
        )
        # worker 0's loop: the built-in one in a thread, or the one given (a program's)
        self.worker_zero = worker_zero or (WorkerZero(task) if trains else None)
        # Last: its TensorBoard writer's thread starts here, and `run` closes it.
        self.progress = Progress(task, membership=self.membership)
        self.coordination = Coordination(
            task,
            membership=self.membership,
            checkpointer=checkpointer,
            progress=self.progress,
            queue=self.queue,
        )

    def run(self) -> int:
        """Coordinates the job to its end: 0 once its outcome is recorded (the summary in the
        termination log) and the ps tasks are told to shut down.

        Every ps is told to shut down only then. On any failure before (the chief's own, or a
        cause that ends the job: `outcome.JobFailure`), the ps tasks stay serving: a
        replacement chief adopts them, or the control plane removes them as the job ends. A
        ps lost while finishing is recovered like one lost while training, and the finish is
        done again (`Finish` is resumable, by this chief or by its replacement)."""
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.task.metrics.ready.set()
        client = self.task.ps_client()
        worker_zero = self.worker_zero
        try:
            self.coordination.initialise(client)
            if worker_zero is not None:
                worker_zero.start()
            while True:
                code = self.coordination.watch(
                    client, check=worker_zero.check if worker_zero else _nothing
                )
                if code != 0:
                    log.error("the chief failed: leaving every ps serving for a replacement")
                    return code
                try:
                    self.finish.run(
                        client,
                        started_from=self.coordination.started_from,
                        recoveries=self.coordination.recoveries,
                    )
                    break
                except PsClientError as err:
                    if not ps_gone(err):
                        raise
                    log.warning("%s while finishing: recovering, then finishing again", err)
            if worker_zero is not None:
                worker_zero.join()
                worker_zero.check()
            return 0
        finally:
            self.task.metrics.training.set(0)
            if worker_zero is not None and self.task.stop.is_set:
                worker_zero.join(timeout=stopping.PUSH_GRACE_SECONDS + 1)
            if self.task.stop.is_set:  # after worker 0's last push: on SIGTERM, a checkpoint
                self.preemption.run(client, brought_up=bool(self.coordination.started_from))
            self.checkpointer.abandon()
            self.task.metrics.ready.clear()
            self.progress.close()
            client.close()
            self._server.stop(2).wait()


def _nothing() -> None:
    """No worker 0 to check on (the job has a chief task)."""
