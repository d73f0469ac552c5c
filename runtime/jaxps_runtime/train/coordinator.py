"""The Coordinator service the chief serves: who is alive, how far they are, when to stop.

Workers and the evaluator register, then heartbeat every `heartbeatSeconds` with their step,
loss and metrics; a reply carries the stop signal. A worker silent for `workerTimeoutSeconds`
is dead until it heartbeats again: the chief then tells the ps tasks, so sync mode aggregates
one gradient fewer per step instead of hanging (TF#5022).

The workers are not fixed: a worker the cluster spec did not list joins when it registers (the
job was scaled up), and a worker that says it leaves (scaled down) is no longer one. Workers
lease their data from the job's one shard queue (`Lease`, `shardqueue`).

`Membership` is thread-safe (one lock); the servicer only translates to and from it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from jaxps.v1 import coordinator_pb2 as co_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.process import stopping
from jaxps_runtime.train.shardqueue import Answer, ShardQueue
from jaxps_runtime.wire import rpc
from jaxps_runtime.wire.credentials import TaskCredentials

log = logging.getLogger(__name__)

MAX_LEASE_WAIT_MS = 1000  # how long a Lease call may be held (LeaseRequest.wait_ms)


@dataclass
class Member:
    """What the chief knows of one task."""

    task: str
    last_seen: float
    incarnation: int = 0
    step: int = 0
    loss: float = math.nan
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    examples_per_second: float = 0.0
    waiting: str = ""  # what it waits for, as it said in its last heartbeat


class Membership:
    """The tasks of a job as the chief sees them. Thread-safe."""

    def __init__(self, *, job_id: str, workers: Sequence[str], now: float) -> None:
        self.job_id = job_id
        self._workers = list(workers)
        self._lock = threading.Lock()
        self._members = {w: Member(w, last_seen=now) for w in workers}
        self.stop = False
        self.step = 0
        self.epoch = 0
        self._told: set[str] = set()  # tasks a reply has told to stop
        self._left: dict[str, int] = {}  # workers that left: the incarnation that did

    def seen(self, request: co_pb2.HeartbeatRequest | co_pb2.RegisterRequest, now: float) -> None:
        task = request.id.task
        with self._lock:
            member = self._members.setdefault(task, Member(task, last_seen=now))
            if self._left.get(task) == request.task_incarnation:
                return  # a word from a worker that left, sent before it went: not a return
            if task.startswith("worker-") and task not in self._workers:
                log.info("%s joins the job", task)
                self._workers = sorted([*self._workers, task], key=_index)
            if member.incarnation and member.incarnation != request.task_incarnation:
                log.info(
                    "%s restarted (incarnation %d -> %d)",
                    task,
                    member.incarnation,
                    request.task_incarnation,
                )
            member.incarnation = request.task_incarnation
            member.last_seen = now
            if isinstance(request, co_pb2.HeartbeatRequest):
                member.step, member.loss, member.done = request.step, request.loss, request.done
                member.metrics = dict(request.metrics)
                member.examples_per_second = request.examples_per_second
                member.waiting = request.waiting

    @property
    def workers(self) -> tuple[str, ...]:
        """The job's workers now: the cluster spec's, those that joined, not those that left."""
        with self._lock:
            return tuple(self._workers)

    def left(self, task: str) -> bool:
        """`task` says it leaves the job (scaled down): it is no longer one of its workers. True
        the first time."""
        with self._lock:
            if task not in self._workers:
                return False
            self._workers.remove(task)
            self._left[task] = self._members[task].incarnation
            return True

    def watching_from(self, now: float) -> None:
        """The chief starts watching: a worker not heard from yet, or heard from only before
        the ps were ready (however long that took), counts as seen now."""
        with self._lock:
            for member in self._members.values():
                member.last_seen = max(member.last_seen, now)

    def live_workers(self, *, now: float, timeout: float) -> list[str]:
        """Workers heard from within `timeout` or done; in cluster order."""
        with self._lock:
            return [
                w
                for w in self._workers
                if self._members[w].done or now - self._members[w].last_seen <= timeout
            ]

    def members(self) -> list[Member]:
        with self._lock:
            return [Member(**vars(m)) for m in self._members.values()]

    def member(self, task: str) -> Member | None:
        with self._lock:
            m = self._members.get(task)
            return Member(**vars(m)) if m else None

    def told_stop(self, task: str) -> None:
        """A reply carried the stop to `task`."""
        with self._lock:
            self._told.add(task)

    def not_told(self, *, now: float, timeout: float) -> list[str]:
        """Live workers (heard from within `timeout`) no reply has told to stop yet."""
        with self._lock:
            return [
                w
                for w in self._workers
                if w not in self._told and now - self._members[w].last_seen <= timeout
            ]

    def mean_loss(self) -> float:
        workers = self.workers
        losses = [m.loss for m in self.members() if m.task in workers and not math.isnan(m.loss)]
        return sum(losses) / len(losses) if losses else math.nan


def _abort_other_job(
    context: grpc.ServicerContext, job_id: str, caller: tensor_pb2.Identity, method: str
) -> None:
    if caller.job_id != job_id:
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method}: job id {caller.job_id!r} is not this chief's job {job_id!r}",
        )


class CoordinatorServicer:
    """Serves `jaxps.v1.Coordinator` from a `Membership`.

    With mutual TLS, `rpc.Guard` (`authz.Gate`) lets a Register or Heartbeat through only when
    its `id.task` is the caller's own certificate identity, so a member's liveness, step and
    done are only ever recorded by that task itself. In plaintext nobody has an identity and
    any task may speak for any other: that mode trusts its network.
    """

    def __init__(self, membership: Membership, *, task: str, queue: ShardQueue) -> None:
        self.membership = membership
        self.task = task
        self.queue = queue

    def _state(self) -> co_pb2.CoordinatorState:
        m = self.membership
        live = m.live_workers(now=time.monotonic(), timeout=math.inf)
        return co_pb2.CoordinatorState(
            id=tensor_pb2.Identity(job_id=m.job_id, cluster_epoch=m.epoch, task=self.task),
            step=m.step,
            stop=m.stop,
            live_workers=len(live),
        )

    def Register(self, request: co_pb2.RegisterRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        _abort_other_job(context, self.membership.job_id, request.id, "Register")
        before = self.membership.member(request.id.task)
        self.membership.seen(request, time.monotonic())
        if before is not None and before.incarnation != request.task_incarnation:
            self.queue.reclaim(request.id.task)  # a new process: its leases died with the old
        if request.id.task in self.membership.workers:  # not a word of one that left
            self.queue.join(request.id.task)
        state = self._state()
        log.info("%s registered", request.id.task)
        return state

    def Heartbeat(self, request: co_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        _abort_other_job(context, self.membership.job_id, request.id, "Heartbeat")
        self.membership.seen(request, time.monotonic())
        state = self._state()
        if state.stop:
            self.membership.told_stop(request.id.task)
        return state

    def Lease(self, request: co_pb2.LeaseRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        _abort_other_job(context, self.membership.job_id, request.id, "Lease")
        worker = request.id.task
        member = self.membership.member(worker)
        if member is None or member.incarnation != request.task_incarnation:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Lease: {worker} (incarnation {request.task_incarnation}) is not registered",
            )
        self.queue.done(worker, request.done)
        if request.returned:
            self.queue.give_back(worker, {r.lease: r.applied for r in request.returned})
        if request.leaving:
            if self.membership.left(worker):
                log.info("%s leaves the job (its leases given back)", worker)
            self.queue.leave(worker)
            answer = Answer(waiting="leaving")
        elif request.want:
            left = context.time_remaining()
            if left is not None and left <= 0:  # its caller has given up on it: what it holds
                # may have changed since (a retry answered first), so it takes back nothing
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Lease: past its deadline")
            wait = min(request.wait_ms, MAX_LEASE_WAIT_MS) / 1000
            answer = self.queue.lease(worker, wait=wait, held=request.held)
        else:
            answer = Answer()
        m = self.membership
        reply = co_pb2.LeaseReply(
            id=tensor_pb2.Identity(job_id=m.job_id, cluster_epoch=m.epoch, task=self.task),
            waiting=answer.waiting,
            over=answer.over,
            hold=answer.hold,
            epoch=self.queue.counts().epoch,
        )
        if answer.lease is not None:
            lease = answer.lease
            reply.lease.CopyFrom(
                co_pb2.ShardLease(
                    lease=lease.lease,
                    epoch=lease.epoch,
                    shard=lease.shard,
                    first=lease.first,
                    end=lease.end,
                    start=lease.start,
                    skip=lease.skip,
                )
            )
        return reply


def _index(task: str) -> int:
    return int(task.rsplit("-", 1)[-1]) if task.rsplit("-", 1)[-1].isdigit() else 1 << 30


class CoordinatorClient:
    """A task's link to the chief. Failures are logged, never raised: training goes on.

    Once the task is stopping (`stopping`), its channel is closed, `register` raises
    `stopping.Stopped` and `heartbeat` sends nothing: a stopped task does not say it is done.
    """

    def __init__(
        self,
        *,
        address: str,
        job_id: str,
        task: str,
        incarnation: int,
        stop: stopping.Stop | None = None,
        credentials: TaskCredentials | None = None,
    ) -> None:
        self._channel = rpc.channel(address, credentials)
        self._calls = rpc.COORDINATOR.callables(self._channel)
        self._id = tensor_pb2.Identity(job_id=job_id, task=task)
        self._incarnation = incarnation
        self.address = address
        self._warned = 0.0
        self._stop = stop or stopping.Stop()
        self._unregister = self._stop.callback(self._channel.close)

    def register(self, *, timeout: float) -> co_pb2.CoordinatorState | None:
        request = co_pb2.RegisterRequest(id=self._id, task_incarnation=self._incarnation)
        started = last_log = time.monotonic()
        while True:
            self._stop.check()
            try:
                state: co_pb2.CoordinatorState = self._calls["Register"](
                    request, timeout=2, wait_for_ready=True
                )
                return state
            except ValueError:  # grpc's "Cannot invoke RPC on closed channel!": stopping
                self._stop.check()
                raise
            except grpc.RpcError as err:
                self._stop.check()
                if err.code() == grpc.StatusCode.PERMISSION_DENIED:
                    raise
                waited = time.monotonic() - started
                if waited > timeout:
                    log.warning(
                        "the chief at %s did not answer for %.0f s (%s); training without it",
                        self.address,
                        waited,
                        err.details(),
                    )
                    return None
                if time.monotonic() - last_log >= 5:
                    log.info("waiting for the chief at %s (%.0f s)", self.address, waited)
                    last_log = time.monotonic()

    def heartbeat(
        self,
        *,
        step: int,
        loss: float,
        done: bool = False,
        metrics: dict[str, float] | None = None,
        examples_per_second: float = 0.0,
        waiting: str = "",
    ) -> co_pb2.CoordinatorState | None:
        request = co_pb2.HeartbeatRequest(
            id=self._id,
            task_incarnation=self._incarnation,
            step=step,
            loss=loss,
            done=done,
            metrics=metrics or {},
            examples_per_second=examples_per_second,
            waiting=waiting,
        )
        if self._stop.is_set:
            return None
        try:
            state: co_pb2.CoordinatorState = self._calls["Heartbeat"](request, timeout=5)
            return state
        except ValueError:  # grpc's "Cannot invoke RPC on closed channel!"
            if self._stop.is_set:
                return None
            raise
        except grpc.RpcError as err:
            if self._stop.is_set:
                return None
            if time.monotonic() - self._warned > 10:
                log.warning(
                    "heartbeat to the chief at %s failed: %s",
                    self.address,
                    err.details() or err.code().name,
                )
                self._warned = time.monotonic()
            return None

    def lease(
        self,
        *,
        done: Sequence[int] = (),
        returned: Mapping[int, int] | None = None,
        want: bool = True,
        leaving: bool = False,
        wait_ms: int = 0,
        held: Sequence[int] = (),
        timeout: float = 10.0,
    ) -> co_pb2.LeaseReply:
        """One call to the shard queue (`CoordinatorServicer.Lease`); raises grpc.RpcError
        (the worker retries, or gives up when the chief stays away). `wait_ms`: the chief may
        hold the call that long while the epoch's last shards are leased to others. `held`
        (with `want`): every lease the worker holds; the chief takes back its others."""
        request = co_pb2.LeaseRequest(
            id=self._id,
            task_incarnation=self._incarnation,
            done=list(done),
            returned=[
                co_pb2.ReturnedLease(lease=k, applied=v) for k, v in (returned or {}).items()
            ],
            want=want,
            leaving=leaving,
            wait_ms=wait_ms,
            held=list(held),
        )
        reply: co_pb2.LeaseReply = self._calls["Lease"](request, timeout=timeout + wait_ms / 1000)
        return reply

    def close(self) -> None:
        self._unregister()
        self._channel.close()
