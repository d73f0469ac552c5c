"""A ps's state as of one step, taken for a checkpoint (`Snapshot`, `Saves`), and a checkpoint's
state checked against the shards and optimizer of the last Init before it is restored (`loaded`).

Writing and reading the files is `shardfile`'s; this module holds no file and no lock of its own:
`Saves` is called with the store's lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
import jax
import numpy as np

from jaxps_runtime.ps import optim
from jaxps_runtime.ps.held import Held
from jaxps_runtime.ps.modes.policy import PsError


def readable(value: Any) -> Any:
    """What a reader may keep and read without the lock: a copy of a host array (updated in
    place later), the value itself when it is an immutable jax array."""
    return np.array(value) if isinstance(value, np.ndarray) else value


@dataclass(frozen=True)
class Snapshot:
    """A ps's shards and optimizer states as they were when its step was `step`.

    Values and states are immutable jax arrays (holding references is the whole copy) or
    copies of the host arrays that row updates change in place.
    """

    step: int
    epoch: int
    optimizer: str
    values: dict[str, jax.Array]
    states: dict[str, Any]
    cursors: dict[str, int] = field(default_factory=dict)  # workers' data cursors at `step`
    # dynamic tables' parts, each `dynamic.Table.snapshot`'s arrays (copies), by shard
    tables: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        tensors: Mapping[str, Held],
        *,
        step: int,
        epoch: int,
        optimizer: str,
        cursors: Mapping[str, int],
    ) -> Snapshot:
        """The snapshot of `tensors` now: with the store's lock held."""
        held = tensors.items()
        return cls(
            step=step,
            epoch=epoch,
            optimizer=optimizer,
            values={n: readable(h.value) for n, h in held if h.value is not None and not h.dynamic},
            states={
                n: jax.tree_util.tree_map(readable, h.opt_state) for n, h in held if not h.dynamic
            },
            cursors=dict(cursors),
            tables={n: h.dynamic.snapshot() for n, h in held if h.dynamic is not None},
        )


class Saves:
    """Snapshots asked for at a step the ps has not reached: each is taken when the step comes
    (`reached`), or fails when a new Init starts over (`fail`). Not thread-safe: called with
    the store's lock held."""

    def __init__(self) -> None:
        self._asked: dict[int, Future[Snapshot]] = {}

    def ask(self, step: int) -> Future[Snapshot]:
        return self._asked.setdefault(step, Future())

    def reached(self, step: int, take: Callable[[], Snapshot], *, in_flight: int = 0) -> None:
        """The step is now `step`: takes the snapshot if one was asked for it, unless pushes
        are `in_flight` (their updates may be in the values, not in the step): then that save
        fails rather than cut a fuzzy checkpoint."""
        future = self._asked.pop(step, None)
        if future is None:
            return
        if in_flight:
            future.set_exception(PsError(grpc.StatusCode.ABORTED, _fuzzy(step, in_flight)))
        else:
            future.set_result(take())

    def lowest(self) -> int | None:
        """The lowest step a snapshot is asked for, or None."""
        return min(self._asked, default=None)

    def fail(self, why: str) -> None:
        for step, future in self._asked.items():
            future.set_exception(PsError(grpc.StatusCode.ABORTED, f"Save at step {step}: {why}"))
        self._asked.clear()


def _fuzzy(step: int, in_flight: int) -> str:
    return (
        f"Save at step {step}: {in_flight} push(es) in flight whose updates the step does not "
        "count yet; ask for a later step"
    )


def fuzzy(step: int, in_flight: int) -> PsError:
    """The refusal of a snapshot at `step` now: it would hold uncounted updates."""
    return PsError(grpc.StatusCode.FAILED_PRECONDITION, _fuzzy(step, in_flight))


def wait(
    future: Future[Snapshot],
    *,
    task: str,
    is_active: Callable[[], bool],
    stopping: Callable[[], bool],
) -> Snapshot:
    """The snapshot, once taken; CANCELLED when the caller goes away, UNAVAILABLE when the ps
    shuts down first."""
    while True:
        try:
            return future.result(timeout=0.5)
        except TimeoutError:
            if not is_active():
                raise PsError(grpc.StatusCode.CANCELLED, "the caller went away") from None
            if stopping():
                raise PsError(grpc.StatusCode.UNAVAILABLE, f"{task} is shutting down") from None


def loaded(
    tensors: Mapping[str, Held],
    applier: Callable[[str], optim.Applier],
    *,
    values: Mapping[str, np.ndarray],
    states: Mapping[str, list[np.ndarray]],
    where: str,
) -> dict[str, tuple[jax.Array, Any]]:
    """Every declared shard's value and optimizer state from a checkpoint (`where`), on the
    device; FAILED_PRECONDITION if one is missing, or is not of its declared dtype and shape,
    or its state does not fit its optimizer (`applier(shard name)`). Nothing is changed."""
    tensors = {n: h for n, h in tensors.items() if h.dynamic is None}  # `restore`'s own
    missing = sorted(set(tensors) - set(values))
    if missing:
        raise PsError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"Restore: {where} has no shard {missing[0]!r}; the placement differs",
        )
    out: dict[str, tuple[jax.Array, Any]] = {}
    for name, held in tensors.items():
        array = values[name]
        if tuple(array.shape) != held.spec.shape or array.dtype != held.spec.dtype:
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Restore: {where}: shard {name!r} is {array.dtype}{list(array.shape)}, "
                f"declared {held.spec.dtype.name}{list(held.spec.shape)}",
            )
        value = jax.device_put(array)
        template = applier(name).init(value)
        leaves, treedef = jax.tree_util.tree_flatten(template)
        saved = states.get(name, [])
        if len(saved) != len(leaves) or any(
            np.shape(a) != np.shape(b) for a, b in zip(saved, leaves, strict=True)
        ):
            raise PsError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Restore: {where}: the optimizer state of {name!r} does not fit the "
                "optimizer (was it saved with another one?)",
            )
        state = jax.tree_util.tree_unflatten(
            treedef, [jax.device_put(np.asarray(a)) for a in saved]
        )
        out[name] = (value, state)
    return out
