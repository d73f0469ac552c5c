"""How a ps turns pushed gradients into updates: the interface of its training modes.

A `Policy` is the part of a ps that differs between `TrainingMode`s; `store.ParameterStore`
holds the state and the locking, its `updates.Updater` the updates themselves, and the store
builds one policy per Init, on the narrow `Store` below:
- `asynchronous.Async`: every gradient is applied on arrival and counts one step;
- `bounded.Bounded`: the same, and a read waits while its worker is too far ahead;
- `sync.Sync`: one gradient per live worker and step is summed in place; the mean is
  applied once they are in, and gradients of a closed step are refused as stale.
Each policy is driven directly by its tests, without gRPC. Errors are `PsError`s carrying the
gRPC status code the servicer answers with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.ps.held import Counters, Held
from jaxps_runtime.ps.positions import Claim


class Store(Protocol):
    """What a mode may use of its ps's state; `store.ParameterStore` is the one there is."""

    task: str
    counters: Counters

    @property
    def state(self) -> ps_pb2.PsState: ...

    @property
    def step(self) -> int: ...

    @property
    def lock(self) -> threading.RLock: ...

    @property
    def changed(self) -> threading.Condition: ...

    def find(self, name: str) -> Held | None: ...

    def apply_dense(
        self, held: Held, grad: np.ndarray, *, push_id: str, who: str = "an update"
    ) -> Future[None]: ...

    def settle(self, pending: Iterable[Future[None]]) -> None: ...

    def count_push(self, push_id: str, claims: Iterable[Claim]) -> tuple[bool, int]: ...

    def drop(self, claim: Claim | None) -> None: ...

    def next_save(self) -> int | None: ...


class PsError(Exception):
    """A request the ps refuses; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    step: int
    reason: str = ""


@dataclass(frozen=True)
class Push:
    """One push as a policy sees it, once its tensors are in: who sent it, at which step, the
    batch of data it claimed (`positions`; None for a push that carries none), and its dense
    gradients (held shard, gradient) by shard name (sync sums them; async policies get them
    applied already)."""

    push_id: str
    step: int
    worker: str
    claim: Claim | None
    dense: Mapping[str, tuple[Held, np.ndarray]]
    # No tensor and no batch: the worker has no data now (a data epoch ends while others
    # finish theirs). Sync counts it as the worker's share of the step; the other modes count
    # no step, and bounded staleness no longer holds anyone back for that worker.
    idle: bool = False


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

    def in_flight(self) -> int:
        """Pushes (or a sync step) whose updates may be in the values but are not counted yet:
        a snapshot now would be fuzzy. With the store's lock held."""

    def count(self, push: Push) -> PushResult:
        """Counts an admitted push whose tensors are in (and applied, when on arrival)."""

    def count_applied(self, worker: str, step: int) -> None:
        """`worker` pushed, at `step`, a batch this ps applied already: sync counts it as that
        worker's gradient of the step, with nothing to add (the step waits for it otherwise)."""

    def before_read(self, worker: str, *, is_active: Callable[[], bool]) -> None:
        """Blocks a read while the mode holds `worker` back."""

    def awaiting(self) -> int:
        """Gradients still awaited for the current step (sync; 0 otherwise)."""

    def set_workers(self, workers: Sequence[str]) -> None:
        """The live workers changed."""
