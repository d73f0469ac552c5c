"""How a ps turns pushed gradients into updates: the interface of its training modes.

A `Policy` is the part of a ps that differs between `TrainingMode`s; `shards.ParameterStore`
holds the state, the locking and the updates themselves, and builds one policy per Init:
- `mode_async.Async`: every gradient is applied on arrival and counts one step;
- `mode_bounded.Bounded`: the same, and a read waits while its worker is too far ahead;
- `mode_sync.Sync`: one gradient per live worker and step is summed in place; the mean is
  applied once they are in, and gradients of a closed step are refused as stale.
Each policy is driven directly by its tests, without gRPC. Errors are `PsError`s carrying the
gRPC status code the servicer answers with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2

if TYPE_CHECKING:
    from jaxps_runtime.shards import Held


# Why a ps refused an update: the `reason` of its PsError (the trailing `rpc.REASON_KEY` of its
# INVALID_ARGUMENT) and the reason label of `jaxps_ps_refused_updates_total`.
NONFINITE_GRADIENT = "nonfinite_gradient"  # a pushed gradient has a NaN or an inf
NONFINITE_UPDATE = "nonfinite_update"  # the optimizer's step made a parameter NaN or inf
# The request means nothing a worker of this job can send: a step the mode does not allow, a
# shard this ps does not hold or of another shape or dtype, rows of a dense shard, a row out of
# range, a name twice, more tensors than this ps holds.
INVALID_REQUEST = "invalid_request"
REFUSALS = (NONFINITE_GRADIENT, NONFINITE_UPDATE, INVALID_REQUEST)


class PsError(Exception):
    """A request the ps refuses; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


@dataclass(frozen=True)
class Mode:
    """How pushed gradients become updates (see `TrainingMode` in the proto)."""

    kind: ps_pb2.TrainingMode = ps_pb2.ASYNC
    replicas_to_aggregate: int = 0  # sync: 0 = one per live worker
    max_staleness: int = 0  # bounded staleness
    last_step: int = 0  # pushes refused from this step on; 0 = no limit

    def read_step_problem(self, min_step: int, *, what: str = "min_step") -> str | None:
        """What is wrong with waiting for step `min_step` (a Read's, or a Save's: `what`), or
        None: a negative step, or one past the last step, which never comes (the wait would
        hold a ps thread until the caller gives up). With no last step, any step may come."""
        if min_step < 0:
            return f"{what} {min_step} is negative"
        if self.last_step and min_step > self.last_step:
            return (
                f"{what} {min_step} is past the last step {self.last_step}; the ps never gets there"
            )
        return None


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    step: int
    reason: str = ""


@dataclass(frozen=True)
class Push:
    """One push as a policy sees it, once its tensors are in: who sent it, at which step, with
    which data cursor, and its dense gradients (held shard, gradient) by shard name (sync sums
    them; async policies get them applied already)."""

    push_id: str
    step: int
    worker: str
    cursor: int
    dense: Mapping[str, tuple[Held, np.ndarray]]


class Policy(Protocol):
    """The mode-specific decisions of one ps, for one epoch (a new Init builds a new one)."""

    # True: each dense shard is updated as soon as its bytes are in; False: `count` gets the
    # dense gradients and decides when they are applied.
    applies_on_arrival: bool

    def step_problem(self, step: int) -> str | None:
        """What is wrong with a push computed at `step` that no honest worker sends (a step
        the ps has not reached), or None. Checked before anything of the push is read; a stale
        step is no problem here but `admit`'s refusal."""

    def admit(self, step: int) -> PushResult | None:
        """A refusal for a push computed at `step`, decided before its bytes are read; or
        None, and then exactly one of `count` or `release` follows."""

    def release(self) -> None:
        """An admitted push failed before it counted."""

    def count(self, push: Push) -> PushResult:
        """Counts an admitted push whose tensors are in (and applied, when on arrival)."""

    def before_read(self, worker: str, *, is_active: Callable[[], bool]) -> None:
        """Blocks a read while the mode holds `worker` back."""

    def awaiting(self) -> int:
        """Gradients still awaited for the current step (sync; 0 otherwise)."""

    def set_workers(self, workers: Sequence[str]) -> None:
        """The live workers changed."""
