"""Waiting for the ps tier: until every ps answers (`reachable`), then until every ps is READY
at one epoch (`ready`), logging which ps it still waits for, where, and in which state.
"""

from __future__ import annotations

import logging
import time

import grpc

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.client.connections import Connections
from jaxps_runtime.client.errors import PsClientError
from jaxps_runtime.process import stopping

log = logging.getLogger(__name__)
# How often `ready` asks every ps for its state.
READY_POLL_SECONDS = 0.05
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def reachable(
    ps: Connections, *, timeout: float, log_every: float, stop: stopping.Stop
) -> list[ps_pb2.StatusReply]:
    """Every ps's Status, once every ps answers; `TimeoutError` naming those that did not."""
    started = last_log = time.monotonic()
    replies: list[ps_pb2.StatusReply | None] = [None] * len(ps.addresses)
    while True:
        stop.check()
        for i, reply in enumerate(replies):
            if reply is None:
                try:
                    replies[i] = ps.status(i, timeout=1.0, wait_for_ready=True)
                except PsClientError as err:
                    if err.code not in UNREACHABLE:
                        raise
        waiting = [i for i, r in enumerate(replies) if r is None]
        if not waiting:
            return [r for r in replies if r is not None]
        elapsed = time.monotonic() - started
        names = ", ".join(f"ps-{i} at {ps.addresses[i]}" for i in waiting)
        if elapsed >= timeout:
            raise TimeoutError(f"{ps.task}: no answer from {names} after {elapsed:.0f} s")
        if time.monotonic() - last_log >= log_every:
            log.info("%s: waiting for %s (%.0f s)", ps.task, names, elapsed)
            last_log = time.monotonic()


def ready(
    ps: Connections, *, timeout: float, log_every: float, stop: stopping.Stop
) -> list[ps_pb2.StatusReply]:
    """Every ps's Status, once every ps is READY at one epoch (the chief initialised them)."""
    reachable(ps, timeout=timeout, log_every=log_every, stop=stop)
    started = last_log = time.monotonic()
    while True:
        replies = ps.each(lambda i: ps.status(i, timeout=10))
        epochs = {r.id.cluster_epoch for r in replies}
        waiting = [i for i, r in enumerate(replies) if r.state != ps_pb2.READY]
        if not waiting and len(epochs) == 1:
            return replies
        elapsed = time.monotonic() - started
        names = (
            ", ".join(f"ps-{i} ({ps_pb2.PsState.Name(replies[i].state)})" for i in waiting)
            or f"one epoch (ps are at {sorted(epochs)})"
        )
        if elapsed >= timeout:
            raise TimeoutError(f"{ps.task}: still waiting for {names} after {elapsed:.0f} s")
        if time.monotonic() - last_log >= log_every:
            log.info("%s: waiting for the chief to initialise %s", ps.task, names)
            last_log = time.monotonic()
        stop.sleep(READY_POLL_SECONDS)
