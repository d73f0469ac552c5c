"""The chief's calls of the ps tier (`ChiefCalls`, a part of `psclient.PsClient`): Init and the
initial values (Assign), Save, Restore, SetWorkers and Shutdown, each made of every ps at once.
What they share with the data calls (Read, Update) is the client's: its connections, its
routes, the epoch and the incarnations it has seen (`psclient`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import grpc
import numpy as np

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps.v1 import tensor_pb2
from jaxps_runtime.client import routing
from jaxps_runtime.client.connections import Connections
from jaxps_runtime.client.errors import PsClientError
from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.process import stopping
from jaxps_runtime.wire import tables as wire_tables
from jaxps_runtime.wire.terms import Mode


class ChiefCalls:
    """The chief's calls; the client (`psclient.PsClient`) holds what they use."""

    _ps: Connections
    _routes: routing.Routes
    _stop: stopping.Stop
    job_id: str
    task: str
    epoch: int
    addresses: Sequence[str]

    def identity(self, ps: int) -> tensor_pb2.Identity:
        raise NotImplementedError  # the client's

    def init(
        self,
        params: Mapping[str, np.ndarray] | None,
        *,
        optimizer: OptimizerConfig,
        epoch: int,
        step: int = 0,
        mode: Mode | None = None,
        workers: Sequence[str] = (),
        tables: Collection[str] | None = None,
        optimizers: Mapping[str, OptimizerConfig] | None = None,
        dynamic: Mapping[str, wire_tables.Spec] | None = None,
    ) -> None:
        """Declares every ps's shards and mode (`optimizers`: {variable: its own optimizer}), then
        streams their initial values (chief only). With `params` None the shards are only
        declared: `restore` fills them from a checkpoint. `tables`: the variables workers update
        by rows (embedding tables, `Task.tables`); each ps then refuses rows of any other shard
        and whole gradients of these. None declares nothing (either kind of update is taken).
        `dynamic`: the dynamic tables ({variable: the spec of one ps's part}): no values of
        theirs are sent (an id's first value is the ps's function of it)."""
        self.epoch = epoch
        mode = mode or Mode()
        arrays = self._routes.arrays(params, what="params") if params is not None else None

        def one(ps: int) -> None:
            shards = self._routes.shards_on(ps)
            request = ps_pb2.InitRequest(
                id=self.identity(ps),
                tensors=routing.declared_specs(
                    shards, tables, optimizers, dynamic, num_ps=len(self.addresses)
                ),
                optimizer=optimizer.to_json(),
                step=step,
                mode=mode.kind,
                replicas_to_aggregate=mode.replicas_to_aggregate,
                max_staleness=mode.max_staleness,
                last_step=mode.last_step,
                workers=list(workers),
            )
            self._ps.seen(ps, self._ps.unary(ps, "Init", request).id)
            shards = [s for s in shards if s.variable.name not in self._routes.dynamic]
            if arrays is None or not shards:
                return
            header = tensor_pb2.FrameHeader(
                id=self.identity(ps), step=step, tensors=[routing.spec(s) for s in shards]
            )
            self._ps.assign(ps, header, routing.buffers(arrays, shards))

        self._ps.each(one)

    def save(self, *, step: int, directory: str, timeout: float) -> list[ps_pb2.CheckpointReply]:
        """Every ps writes its part of the checkpoint of `step` (waiting to get there)."""

        def one(ps: int) -> ps_pb2.CheckpointReply:
            request = ps_pb2.SaveRequest(id=self.identity(ps), step=step, directory=directory)
            reply: ps_pb2.CheckpointReply = self._ps.unary(ps, "Save", request, timeout=timeout)
            return reply

        return self._ps.each(one)

    def restore(
        self,
        files: Sequence[tuple[str, str]],
        *,
        step: int,
        cursors: Sequence[Mapping[str, int]] = (),
    ) -> None:
        """Every ps loads its (file, sha256) of a checkpoint (after `init` declared the
        shards), and its own data positions the checkpoint holds (`cursors[ps]`)."""

        def one(ps: int) -> None:
            file, digest = files[ps]
            request = ps_pb2.RestoreRequest(
                id=self.identity(ps),
                step=step,
                file=file,
                sha256=digest,
                cursors=cursors[ps] if ps < len(cursors) else {},
            )
            self._ps.unary(ps, "Restore", request, timeout=300)

        self._ps.each(one)

    def set_workers(self, workers: Sequence[str]) -> None:
        """Tells every ps which workers are alive (chief only)."""

        def one(ps: int) -> None:
            request = ps_pb2.SetWorkersRequest(id=self.identity(ps), workers=list(workers))
            self._ps.unary(ps, "SetWorkers", request, timeout=30)

        self._ps.each(one)

    def shutdown(self, *, reason: str) -> None:
        """Asks every ps to exit 0; a ps that is already gone counts as done. A ps that
        restarted meanwhile is told too (the request names no incarnation): the job is over.
        Never once the task is stopping (`stopping.Stopped`)."""
        self._stop.check()  # a stopping chief leaves the ps tasks to its replacement

        def one(ps: int) -> None:
            caller = tensor_pb2.Identity(job_id=self.job_id, task=self.task)
            request = ps_pb2.ShutdownRequest(id=caller, reason=reason)
            try:
                self._ps.unary(ps, "Shutdown", request, timeout=10)
            except PsClientError as err:
                if err.code != grpc.StatusCode.UNAVAILABLE:
                    raise

        self._ps.each(one)
