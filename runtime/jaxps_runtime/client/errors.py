"""What a client's call to a ps raises when the ps refused or failed it."""

from __future__ import annotations

import grpc


class PsClientError(RuntimeError):
    """A ps refused or failed a call; says which ps, where, and what it answered."""

    def __init__(
        self,
        *,
        ps: int,
        address: str,
        method: str,
        code: grpc.StatusCode | None,
        details: str,
        reason: str = "",
    ) -> None:
        name = code.name if code else "ERROR"
        super().__init__(f"ps-{ps} at {address}: {method} failed with {name}: {details}")
        self.ps, self.address, self.method, self.code, self.details = (
            ps,
            address,
            method,
            code,
            details,
        )
        self.reason = reason  # the ps's `jaxps-reason` (`terms.REFUSALS`, ...), "" without


class PsLayoutError(PsClientError):
    """A ps answered with other variables (names, shapes, dtypes) than the caller holds: the
    task declared other variables than those the ps tier was initialised with."""


class PsRestartedError(PsClientError):
    """A ps answered with another incarnation than before: it restarted and lost its state."""
