"""Who may call a ps: the first check of every request, before anything of its meaning.

A caller names its job, the ps incarnation it has seen and its cluster epoch; a call of another
job is refused (PERMISSION_DENIED, counted as `refused_job`), one that saw an earlier
incarnation of this ps is told it restarted (`rpc.PS_RESTARTED`), and a data call of another
epoch, or before the chief has initialised or restored the ps, is refused as too early.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.ps.held import STATE_NAMES, Counters
from jaxps_runtime.ps.modes.policy import PsError
from jaxps_runtime.wire import rpc


class Callee(Protocol):
    """What the check needs of a ps (`store.ParameterStore`)."""

    job_id: str
    task: str
    incarnation: int
    counters: Counters

    def standing(self) -> tuple[int, ps_pb2.PsState]:
        """The cluster epoch and state, read together."""
        ...


def check(
    ps: Callee,
    caller: tensor_pb2.Identity,
    *,
    method: str,
    ready: bool = True,
    allow_anonymous: bool = False,
) -> None:
    """Refuses callers of another job, of another ps incarnation or epoch, or too early
    (`ready`: the call needs the ps READY; `allow_anonymous`: a caller with no job id may ask)."""
    if not (allow_anonymous and not caller.job_id) and caller.job_id != ps.job_id:
        ps.counters.add("refused_job")
        raise PsError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method}: job id {caller.job_id!r} is not this ps's job {ps.job_id!r}; "
            "refusing a client of another job",
        )
    if caller.ps_incarnation and caller.ps_incarnation != ps.incarnation:
        raise PsError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{method}: {ps.task} restarted (incarnation {ps.incarnation}, caller saw "
            f"{caller.ps_incarnation}); re-register and pull again",
            reason=rpc.PS_RESTARTED,
        )
    epoch, state = ps.standing()
    if ready and caller.cluster_epoch and caller.cluster_epoch != epoch:
        raise PsError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{method}: cluster epoch is {epoch}, caller is at {caller.cluster_epoch}; pull again",
        )
    if ready and state != ps_pb2.READY:
        raise PsError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{method}: {ps.task} is {STATE_NAMES[state]}; the chief has not initialised "
            "or restored it yet"
            if state != ps_pb2.SHUTTING_DOWN
            else f"{method}: {ps.task} is shutting down",
        )
