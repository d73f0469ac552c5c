"""What a ps and its callers agree on beyond the messages: the mode an Init sets (`wire_mode`
of the configuration's `TrainingMode`), and why a ps refuses an update (the `reason` a
refusal carries, on gRPC and on the bulk path alike)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.config.mode import ModeKind, TrainingMode

# Why a ps refused an update: the `reason` of its PsError (the trailing `rpc.REASON_KEY` of its
# INVALID_ARGUMENT) and the reason label of `jaxps_ps_refused_updates_total`.
NONFINITE_GRADIENT = "nonfinite_gradient"  # a pushed gradient has a NaN or an inf
NONFINITE_UPDATE = "nonfinite_update"  # the optimizer's step made a parameter NaN or inf
# The request means nothing a worker of this job can send: a step the mode does not allow, a
# shard this ps does not hold or of another shape or dtype, rows of a dense shard, a row out of
# range, a name twice, more tensors than this ps holds.
INVALID_REQUEST = "invalid_request"
REFUSALS = (NONFINITE_GRADIENT, NONFINITE_UPDATE, INVALID_REQUEST)


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


_KINDS = {
    ModeKind.SYNC: ps_pb2.SYNC,
    ModeKind.ASYNC: ps_pb2.ASYNC,
    ModeKind.BOUNDED_STALENESS: ps_pb2.BOUNDED_STALENESS,
}


def wire_mode(mode: TrainingMode, *, last_step: int) -> Mode:
    """The `Mode` an Init sends for the configuration's `mode` of a job of `last_step` steps:
    the one place a `ModeKind` becomes the proto's `TrainingMode`."""
    return Mode(
        kind=_KINDS[mode.kind],
        replicas_to_aggregate=mode.replicas_to_aggregate or 0,
        max_staleness=mode.max_staleness,
        last_step=last_step,
    )


# Why a ps did not apply a batch of the job's data (an Update reply's `reason` starts with one
# of these, then ": " and the words): the worker acts on the word, never on the rest.
APPLIED = "applied"  # this ps already applied that batch of that shard: nothing to do again
REVOKED = "revoked"  # the push's lease is older than one the ps took for that shard
GAP = "gap"  # batches of the shard before this one are not applied here: ask for a new lease
BUSY = "busy"  # another push of the same batch is being applied: ask again
POSITION_REFUSALS = (APPLIED, REVOKED, GAP, BUSY)
OVER = "training is over"  # the ps reached the last step: it takes nothing more


def shard_key(epoch: int, shard: int) -> str:
    """The name of a data shard in pushes, positions and checkpoints: "<epoch>:<shard>"."""
    return f"{epoch}:{shard}"


SHARD_KEY_DIGITS = 18  # each number of a shard key: ASCII digits, at most this many (an int64)


def parse_shard_key(key: str) -> tuple[int, int] | None:
    """(epoch, shard) of a `shard_key`; None for anything else (other digits than ASCII's, or
    a number of more than `SHARD_KEY_DIGITS` digits, included)."""
    epoch, sep, shard = key.partition(":")
    if not sep or not (_number(epoch) and _number(shard)):
        return None
    return int(epoch), int(shard)


def _number(text: str) -> bool:
    return 0 < len(text) <= SHARD_KEY_DIGITS and text.isascii() and text.isdigit()


def refusal_word(reason: str) -> str:
    """The word a refusal's reason starts with ("applied", "stale", ...)."""
    return reason.split(":", 1)[0].strip()
