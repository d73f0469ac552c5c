"""Where each data shard is on this ps: the batches of it applied, and the newest lease that
pushed it. What makes a batch count once however often it is pushed.

A push of a batch of the job's data names its shard ("<epoch>:<shard>"), the lease the chief
gave with it and its position (`cursor`: the batches of the shard applied once it counts).
Before a byte of it is read, `claim` decides:
- its lease is older than the newest that pushed this shard: `REVOKED` (a worker whose shard
  was taken back, a zombie, pushes nothing);
- this ps applied that batch already: `APPLIED` (the holder before crashed after this ps took
  it, or a sync step went on without this push: the worker moves on);
- batches of the shard before it are missing here: `GAP`;
- a push of the same batch is being applied right now: `BUSY`;
- else the batch is claimed (in flight) until the push counts (`settle`: the position moves
  with the step, under the store's lock, so a snapshot holds the positions its values match)
  or fails (`drop`).
Positions of older data epochs are forgotten once a push of a newer one counts: the chief's
queue starts an epoch only when every shard of the one before is applied on every ps, so a push
of an older epoch than the newest settled here is answered `APPLIED` (a zombie's, never again).

Not thread-safe by itself: the store calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from jaxps_runtime.wire import terms


class InvalidPositionError(ValueError):
    """A push names a data shard that no honest worker could (`Positions.problem`)."""


@dataclass(frozen=True)
class Claim:
    """One batch of one shard, claimed by a push until it counts or fails."""

    shard: str
    cursor: int  # the shard's position once this batch counts
    lease: int


class Positions:
    def __init__(self, positions: Mapping[str, int] | None = None) -> None:
        self._at: dict[str, int] = {}
        self._leases: dict[str, int] = {}
        self._flying: set[tuple[str, int]] = set()
        self._floor = 0  # the newest data epoch settled here: older ones are all applied
        self.reset(positions or {})

    def reset(self, positions: Mapping[str, int]) -> None:
        """Starts over from `positions` (an Init: none; a Restore: the checkpoint's)."""
        self._at = {k: int(v) for k, v in positions.items() if terms.parse_shard_key(k)}
        self._leases, self._flying = {}, set()
        self._floor = max((self._epoch(k) for k in self._at), default=0)

    @staticmethod
    def _epoch(key: str) -> int:
        parsed = terms.parse_shard_key(key)
        return parsed[0] if parsed else -1

    def problem(self, shard: str) -> str | None:
        """What makes `shard` no data shard an honest worker could push (not a shard key), or
        None. Its epoch is not bounded: a ps restored from a checkpoint (its pod's standby took
        over) is pushed batches of epochs past the checkpoint's until the chief rolls the whole
        tier back."""
        if terms.parse_shard_key(shard) is None:
            return (
                f'{shard[:64]!r} is no data shard ("<epoch>:<shard>", each a number of at '
                f"most {terms.SHARD_KEY_DIGITS} ASCII digits)"
            )
        return None

    def claim(self, *, shard: str, cursor: int, lease: int) -> Claim | str:
        """The claim of the batch `cursor - 1` of `shard`, or the refusal's reason;
        `InvalidPositionError` for a shard no honest worker could push (`problem`)."""
        problem = self.problem(shard)
        if problem is not None:
            raise InvalidPositionError(problem)
        if cursor < 1:
            return f"{terms.GAP}: {shard!r} at {cursor} is no position of a data shard"
        if self._epoch(shard) < self._floor:
            return f"{terms.APPLIED}: data epoch {self._epoch(shard)} is over here"
        newest = self._leases.get(shard, 0)
        if lease < newest:
            return (
                f"{terms.REVOKED}: lease {lease} of shard {shard} was taken back "
                f"({newest} holds it)"
            )
        at = self._at.get(shard, 0)
        if cursor - 1 < at:
            return f"{terms.APPLIED}: batch {cursor - 1} of shard {shard} is applied here"
        if cursor - 1 > at:
            return (
                f"{terms.GAP}: batch {cursor - 1} of shard {shard}, but only {at} of its "
                "batches are applied here"
            )
        if (shard, cursor) in self._flying:
            return f"{terms.BUSY}: batch {cursor - 1} of shard {shard} is being applied"
        self._flying.add((shard, cursor))
        self._leases[shard] = max(newest, lease)
        return Claim(shard, cursor, lease)

    def drop(self, claim: Claim | None) -> None:
        """The claimed push failed or was refused: the batch is free again."""
        if claim is not None:
            self._flying.discard((claim.shard, claim.cursor))

    def settle(self, claims: Iterable[Claim]) -> None:
        """The claimed pushes counted: their shards are at their positions now."""
        newest_epoch = -1
        for claim in claims:
            self._flying.discard((claim.shard, claim.cursor))
            if claim.cursor > self._at.get(claim.shard, 0):
                self._at[claim.shard] = claim.cursor
            parsed = terms.parse_shard_key(claim.shard)
            if parsed is not None:
                newest_epoch = max(newest_epoch, parsed[0])
        if newest_epoch > self._floor:
            self._floor = newest_epoch
            self._forget_before(newest_epoch)

    def _forget_before(self, epoch: int) -> None:
        for key in [k for k in self._at if (terms.parse_shard_key(k) or (epoch, 0))[0] < epoch]:
            del self._at[key]
            self._leases.pop(key, None)

    def snapshot(self) -> dict[str, int]:
        return dict(self._at)
