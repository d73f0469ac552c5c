"""What the chief does about what it observed: a pure decision, table-tested.

Every tick the chief reads one Status per ps and which workers it heard from, and
`decide(policy, state, observation)` says what follows: roll the ps tier back (`Recover`), start
a checkpoint (`Checkpoint`), change the workers sync mode waits for (`SetWorkers`), stop because
the last step is reached (`Stop`), or give up because every worker is gone (`GiveUp`). The
chief's watch loop (`chief.Chief._watch`) is the shell: it observes, calls `decide` and carries
the actions out, in order. Nothing here reads a clock, a socket or a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from jaxps.v1 import parameter_server_pb2 as ps_pb2


@dataclass(frozen=True)
class PsSeen:
    """One ps as its Status answered."""

    incarnation: int
    state: int  # ps_pb2.PsState
    epoch: int
    step: int

    @classmethod
    def of(cls, reply: ps_pb2.StatusReply) -> PsSeen:
        return cls(reply.id.ps_incarnation, reply.state, reply.id.cluster_epoch, reply.step)


@dataclass(frozen=True)
class Observation:
    """One look at the job."""

    now: float
    ps: tuple[PsSeen, ...] = ()
    unreachable: str = ""  # why a Status call failed; then `ps` is empty
    # why a ps did not answer Status in time (DEADLINE_EXCEEDED: paused, overloaded, cut
    # off); then `ps` is empty. No rollback: its state may be whole, and a ps that was lost
    # answers, once replaced, with a new incarnation (`ps_problem`)
    silent: str = ""
    alive: tuple[str, ...] = ()  # workers heard from within workerTimeoutSeconds, or done
    checkpointing: bool = False  # a periodic checkpoint is being written


@dataclass(frozen=True)
class Policy:
    """What the training configuration says about watching."""

    steps: int
    checkpoints: bool = False
    every_steps: int | None = None
    every_seconds: float | None = None


@dataclass(frozen=True)
class State:
    """What the chief believes between two looks."""

    epoch: int
    incarnations: tuple[int, ...]
    live: tuple[str, ...]  # the workers sync mode currently waits for
    last_checkpoint_time: float = 0.0


@dataclass(frozen=True)
class Recover:
    """Roll every ps back to the last committed checkpoint, at a new epoch."""

    reason: str


@dataclass(frozen=True)
class Progress:
    """The global step: the lowest over the ps."""

    step: int


@dataclass(frozen=True)
class Checkpoint:
    """Start the periodic checkpoint of `step` (each ps snapshots when it gets there)."""

    step: int


@dataclass(frozen=True)
class SetWorkers:
    """The live workers changed: `gone` sent no heartbeat in time, `back` came back."""

    workers: tuple[str, ...]
    gone: tuple[str, ...]
    back: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    """The last step is reached: finish (drain the workers, the final checkpoint, evaluate)."""

    step: int


@dataclass(frozen=True)
class GiveUp:
    """Training cannot go on."""

    reason: str


Action = Recover | Progress | Checkpoint | SetWorkers | Stop | GiveUp


def ps_problem(state: State, seen: Sequence[PsSeen]) -> str | None:
    """Why the ps tier needs a rollback (a ps restarted, or is not ready at our epoch)."""
    for i, ps in enumerate(seen):
        if i < len(state.incarnations) and ps.incarnation != state.incarnations[i]:
            return f"ps-{i} restarted (incarnation {ps.incarnation})"
        if ps.state != ps_pb2.READY or ps.epoch != state.epoch:
            return f"ps-{i} is {ps_pb2.PsState.Name(ps.state)} at epoch {ps.epoch}"
    return None


def checkpoint_target(policy: Policy, state: State, obs: Observation, step: int) -> int | None:
    """The step of the next periodic checkpoint, or None if none is due (or one is running).

    With `every_steps` a Save is always pending at the next multiple of it: each ps takes its
    snapshot exactly there, so a crash loses at most one interval. With only `every_seconds`,
    the next step once the time has passed. Never the last step: the final checkpoint covers it.
    """
    if not policy.checkpoints or obs.checkpointing:
        return None
    if policy.every_steps:
        target = (step // policy.every_steps + 1) * policy.every_steps
    elif policy.every_seconds and obs.now - state.last_checkpoint_time >= policy.every_seconds:
        target = step + 1
    else:
        return None
    return target if target < policy.steps else None


def decide(policy: Policy, state: State, obs: Observation) -> tuple[State, list[Action]]:
    """The new state and the actions, in the order they are to be carried out."""
    if obs.unreachable:
        return state, [Recover(obs.unreachable)]
    if obs.silent:  # wait for it: the Stalled clock runs on
        return state, []
    if not obs.ps:
        return state, [Recover("no ps answered")]
    problem = ps_problem(state, obs.ps)
    if problem is not None:
        return state, [Recover(problem)]
    step = min(ps.step for ps in obs.ps)
    actions: list[Action] = [Progress(step)]
    if step >= policy.steps:
        return state, [*actions, Stop(step)]
    target = checkpoint_target(policy, state, obs, step)
    if target is not None:
        actions.append(Checkpoint(target))
        state = dataclasses.replace(state, last_checkpoint_time=obs.now)
    if obs.alive != state.live:
        if not obs.alive:
            return state, [*actions, GiveUp(f"every worker is gone; giving up at step {step}")]
        gone = tuple(w for w in state.live if w not in obs.alive)
        back = tuple(w for w in obs.alive if w not in state.live)
        actions.append(SetWorkers(obs.alive, gone=gone, back=back))
        state = dataclasses.replace(state, live=obs.alive)
    return state, actions
