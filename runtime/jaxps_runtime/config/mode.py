"""The training mode: how pushed gradients become updates, read once from `mode`,
`replicasToAggregate` and `maxStaleness` into one `TrainingMode` that everything else takes
(`wire.terms.wire_mode` makes the ps's Init of it; the checkpoint manifest keeps its kind).

Standard library only; pure and thread-safe.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from jaxps_runtime.config.reader import Reader, fail, setting


class ModeKind(enum.StrEnum):
    """The manifest's `mode`; a `str`, so `kind == "sync"` holds for sync."""

    SYNC = "sync"
    ASYNC = "async"
    BOUNDED_STALENESS = "boundedStaleness"


DEFAULT_MAX_STALENESS = 2


@dataclass(frozen=True)
class ModeFields:
    """The three fields of `spec.training` that say the mode, with their rules (`reader`):
    what `read` reads and `openapi` compares with the CRD."""

    mode: ModeKind = ModeKind.ASYNC
    replicasToAggregate: int | None = setting(None, minimum=1)  # noqa: N815 - manifest spelling
    maxStaleness: int | None = setting(None, minimum=0, static_default=False)  # noqa: N815


@dataclass(frozen=True)
class TrainingMode:
    """How pushed gradients become updates. `replicas_to_aggregate` (sync only): the
    gradients a step waits for, None for every live worker; `max_staleness`
    (boundedStaleness only): how many steps the fastest worker may lead the slowest."""

    kind: ModeKind = ModeKind.ASYNC
    replicas_to_aggregate: int | None = None
    max_staleness: int = DEFAULT_MAX_STALENESS

    def to_manifest(self) -> dict[str, object]:
        """The manifest's fields for this mode (None: no value), as `read` reads them back."""
        bounded = self.kind is ModeKind.BOUNDED_STALENESS
        return {
            "mode": self.kind.value,
            "replicasToAggregate": self.replicas_to_aggregate,
            "maxStaleness": self.max_staleness if bounded else None,
        }


def read(top: Reader) -> TrainingMode:
    """The mode of `top` (the `spec.training` object): `replicasToAggregate` only in sync
    mode, `maxStaleness` only in boundedStaleness; raises naming the field."""
    kind = ModeKind(top.setting("mode", ModeFields))
    replicas = top.setting("replicasToAggregate", ModeFields)
    staleness = top.setting("maxStaleness", ModeFields)
    if replicas is not None and kind is not ModeKind.SYNC:
        raise fail(
            f"{top.path}.replicasToAggregate",
            replicas,
            f"no value unless mode is sync (mode is {kind})",
        )
    if staleness is not None and kind is not ModeKind.BOUNDED_STALENESS:
        raise fail(
            f"{top.path}.maxStaleness",
            staleness,
            f"no value unless mode is boundedStaleness (mode is {kind})",
        )
    return TrainingMode(
        kind=kind,
        replicas_to_aggregate=replicas,
        max_staleness=DEFAULT_MAX_STALENESS if staleness is None else staleness,
    )
