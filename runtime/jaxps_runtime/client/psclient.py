"""The client side of the ps tier: `read` and `update` whole models across every ps, in parallel.

Three rooms, data flowing down once: `PsClient` (here) makes each call's messages, `routing`
says which ps holds which bytes of the caller's arrays, and `connections` carries each ps's
call on its `transport.Transport`, which chooses gRPC or the bulk path. Each ps gets one Read
or Update call per operation, dense shards and embedding rows together. A read writes each
received window straight into the final array of its variable; an update sends byte ranges of
the gradient arrays without copying them first.

Thread-safety: one call at a time per client (pull, push and the rest share per-ps
transports and the incarnations the client has seen). Use one client per thread of work.

Stopping: see `connections`; every call raises `stopping.Stopped` once the task stops.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.client import readiness, routing
from jaxps_runtime.client.connections import Connections
from jaxps_runtime.client.control import ChiefCalls
from jaxps_runtime.client.errors import PsClientError, PsLayoutError, PsRestartedError
from jaxps_runtime.client.placement import Layout, Placement
from jaxps_runtime.process import stopping
from jaxps_runtime.wire import streams
from jaxps_runtime.wire import tables as wire_tables
from jaxps_runtime.wire.credentials import TaskCredentials

__all__ = ["PsClient", "PsClientError", "PsRestartedError", "merged_cursors"]


class _HasCursors(Protocol):
    @property
    def cursors(self) -> Mapping[str, int]: ...


def merged_cursors(
    replies: Sequence[_HasCursors],
    *,
    how: Callable[[Iterable[int]], int],
) -> dict[str, int]:
    """The data shards' positions the ps tasks report, merged over them by `how` (a shard one
    ps has not heard of is at 0 there): `min` is what every ps has applied, where the shard
    queue goes on from."""
    shards = sorted({k for r in replies for k in r.cursors})
    return {k: how(r.cursors.get(k, 0) for r in replies) for k in shards}


class PsClient(ChiefCalls):
    """Pulls parameters from and pushes gradients to every ps of a job; the chief's calls
    that set the ps tier's state up (Init, Save, Restore, ...) are `control.ChiefCalls`'."""

    def __init__(
        self,
        *,
        addresses: Sequence[str],
        placement: Placement,
        job_id: str,
        task: str,
        chunk_bytes: int = streams.CHUNK_BYTES,
        stop: stopping.Stop | None = None,
        credentials: TaskCredentials | None = None,
        use_bulk: bool = True,
        dynamic: Mapping[str, wire_tables.Spec] | None = None,
    ) -> None:
        """`use_bulk=False` keeps every call on gRPC (see `bulk`). `dynamic`: the dynamic
        tables ({variable: spec}), whose ids not resident a read gives their initial value
        (`wire.tables.initial_rows`), computed here: a ps sends the resident rows only."""
        self._routes = routing.Routes(placement, num_ps=len(addresses))
        self.dynamic = dict(dynamic or {})
        missing = sorted(set(placement.dynamic) - set(self.dynamic))
        if missing:
            raise ValueError(f"dynamic table {missing[0]!r}: no spec given for its reads")
        self.placement = placement
        self.job_id, self.task = job_id, task
        self.epoch = 0
        self.cursors: dict[str, int] = {}  # workers' data cursors, as of the last wait_ready
        self._stop = stop or stopping.Stop()
        self._ps = Connections(
            addresses,
            job_id=job_id,
            task=task,
            credentials=credentials,
            use_bulk=use_bulk,
            chunk_bytes=chunk_bytes,
            stop=self._stop,
        )
        self.addresses = self._ps.addresses

    @property
    def incarnations(self) -> list[int]:
        """The incarnation each ps answered with (0: not known; any is taken)."""
        return self._ps.incarnations

    @incarnations.setter
    def incarnations(self, incarnations: list[int]) -> None:
        self._ps.incarnations = incarnations

    @property
    def data_calls(self) -> int:  # Read and Update calls answered
        return self._ps.data_calls

    @property
    def bulk_calls(self) -> int:  # of which on the bulk path
        return self._ps.bulk_calls

    def identity(self, ps: int) -> tensor_pb2.Identity:
        return tensor_pb2.Identity(
            job_id=self.job_id,
            ps_incarnation=self.incarnations[ps],
            cluster_epoch=self.epoch,
            task=self.task,
        )

    # --- control ----------------------------------------------------------------------------

    def status(
        self, ps: int, *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> ps_pb2.StatusReply:
        return self._ps.status(ps, timeout=timeout, wait_for_ready=wait_for_ready)

    def statuses(self, *, timeout: float = 10) -> list[ps_pb2.StatusReply]:
        """Every ps's Status, at once."""
        return self._ps.each(lambda ps: self.status(ps, timeout=timeout))

    def wait_reachable(self, *, timeout: float, log_every: float = 5.0) -> list[ps_pb2.StatusReply]:
        """Waits until every ps answers Status, logging which ps and address it waits for."""
        return readiness.reachable(self._ps, timeout=timeout, log_every=log_every, stop=self._stop)

    def wait_ready(self, *, timeout: float, log_every: float = 5.0) -> int:
        """Waits until every ps is READY at one epoch (the chief initialised them); the step.

        Adopts the epoch and the incarnations the ps tasks report, and the workers' data
        cursors (`cursors`), logging which ps it is still waiting for and in which state.
        """
        replies = readiness.ready(self._ps, timeout=timeout, log_every=log_every, stop=self._stop)
        self.epoch = replies[0].id.cluster_epoch
        self.incarnations = [r.id.ps_incarnation for r in replies]
        self.cursors = merged_cursors(replies, how=max)
        return min(r.step for r in replies)

    # --- data -----------------------------------------------------------------------------

    def read(
        self,
        *,
        min_step: int = 0,
        into: Mapping[str, np.ndarray] | None = None,
        variables: Collection[str] | None = None,
        rows: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[int, dict[str, np.ndarray]]:
        """Every variable whole (or those of `variables`) and the `rows` asked for of tables
        ({variable: row ids}, any order, duplicates allowed), all of one ps read at one step;
        and the lowest step among the ps tasks. `into` (say the previous read's arrays, no
        longer used) receives the values in place: a loop that reuses its buffers saves the page
        faults of 2 x model size of fresh memory per step. Tables hold the rows asked for, in
        that order."""
        arrays = self._routes.into(into, variables)
        picks = self._routes.rows(rows or {})
        picked = self._routes.rows_into(rows or {})

        def one(ps: int) -> int:
            shards = self._routes.shards_on(ps, arrays)
            request = ps_pb2.ReadRequest(
                id=self.identity(ps),
                names=[s.name for s in shards],
                min_step=min_step,
                selections=routing.selections(picks[ps]),
            )
            header, values = self._ps.exchange(
                ps,
                "Read",
                request,
                expect=[*routing.expect(shards), *routing.expect_rows(picks[ps])],
                into=routing.views(arrays, shards),
                up_to=routing.keyed(picks[ps], len(shards), self.dynamic),
            )
            try:
                routing.place_rows(
                    picks[ps],
                    values,
                    header,
                    offset=len(shards),
                    picked=picked,
                    dynamic=self.dynamic,
                )
            except ValueError as err:  # rows of other ids than asked
                raise PsLayoutError(
                    ps=ps, address=self.addresses[ps], method="Read", code=None, details=str(err)
                ) from None
            return header.step

        return min(self._ps.each(one)), {**arrays, **picked}

    def update(
        self,
        grads: Mapping[str, Any],
        *,
        step: int,
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
        counts: Mapping[str, np.ndarray] | None = None,
        variables: Collection[str] | None = None,
        push_id: str | None = None,
        shard: str = "",
        cursor: int = 0,
        lease: int = 0,
        idle: bool = False,
        then_read: bool = False,
        min_step: int = 0,
        into: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[int, dict[str, np.ndarray], list[tensor_pb2.FrameHeader]]:
        """Pushes one gradient to every ps (each counts it, holding its tensors or not): every
        variable's (or `variables'`) whole, and gradient `rows` of tables ({variable: (row ids,
        rows)}; duplicates summed; `counts`: a dynamic table's occurrences of each id in the
        batch, what admission counts), as batch `cursor - 1` of data shard `shard` leased with
        `lease` (each ps applies a batch once: `ps.positions`); `idle`: no data. With `then_read`,
        each ps replies with the dense values once at `min_step` (into `into`, as `read`): a
        sync step's update and the next read in one round trip. A transient failure is retried
        with the same push_id (applied once). Returns (the lowest step replied, the values read,
        each ps's reply header: `accepted`, `reason`, `step`)."""
        arrays = self._routes.arrays(grads, what="gradients", variables=variables)
        read_into = self._routes.into(into, arrays) if then_read else {}
        picks = self._routes.rows({name: ids for name, (ids, _) in (rows or {}).items()})
        push_id = push_id or uuid.uuid4().hex

        def one(ps: int) -> tensor_pb2.FrameHeader:
            shards = self._routes.shards_on(ps, arrays)
            row_specs, row_buffers = routing.row_parts(picks[ps], rows or {}, counts)
            header = tensor_pb2.FrameHeader(
                id=self.identity(ps),
                step=step,
                push_id=push_id,
                tensors=[*map(routing.spec, shards), *row_specs],
                shard=shard,
                cursor=cursor,
                lease=lease,
                idle=idle,
                then_read=then_read,
                min_step=min_step,
            )
            reply, _ = self._ps.exchange(
                ps,
                "Update",
                header,
                buffers=[*routing.buffers(arrays, shards), *row_buffers],
                expect=routing.expect(shards) if then_read else [],
                into=routing.views(read_into, shards) if read_into else [],
            )
            return reply

        with self._ps.push():
            replies = self._ps.each(one)
        return min(r.step for r in replies), read_into, replies

    def pull_tree(self, layout: Layout, *, min_step: int = 0) -> tuple[int, Any]:
        step, named = self.read(min_step=min_step)
        return step, layout.unflatten(named)

    def close(self) -> None:
        self._ps.close()

    def __enter__(self) -> PsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
