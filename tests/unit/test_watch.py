"""The chief's decisions, table-tested: one look at the job in, the actions out."""

from __future__ import annotations

import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.train import watch
from jaxps_runtime.train.watch import (
    Checkpoint,
    GiveUp,
    Observation,
    Policy,
    Progress,
    PsSeen,
    Recover,
    SetWorkers,
    State,
    Stop,
)

W = ("worker-0", "worker-1")
STATE = State(epoch=3, incarnations=(11, 22), live=W, last_checkpoint_time=0.0)
POLICY = Policy(steps=1000, checkpoints=True, every_steps=100)


def ready(
    *steps: int, epoch: int = 3, incarnations: tuple[int, ...] = (11, 22)
) -> tuple[PsSeen, ...]:
    return tuple(
        PsSeen(incarnation=inc, state=ps_pb2.READY, epoch=epoch, step=step)
        for inc, step in zip(incarnations, steps, strict=True)
    )


def look(
    *steps: int, alive: tuple[str, ...] = W, now: float = 10.0, **kwargs: object
) -> Observation:
    return Observation(now=now, ps=ready(*steps, **kwargs), alive=alive)  # type: ignore[arg-type]


CASES = [
    # (what, policy, state, observation, expected actions)
    ("healthy: the step, and the checkpoint pending at the next multiple", POLICY, STATE,
     look(250, 251), [Progress(250), Checkpoint(300)]),
    ("a Status failed: roll back", POLICY, STATE,
     Observation(now=1.0, unreachable="ps-1 at x: Status failed with UNAVAILABLE", alive=W),
     [Recover("ps-1 at x: Status failed with UNAVAILABLE")]),
    ("a ps silent (no answer in time): wait for it, no rollback", POLICY, STATE,
     Observation(now=1.0, silent="ps-1 at x: Status failed with DEADLINE_EXCEEDED", alive=W),
     []),
    ("a ps restarted: roll back, nothing else", POLICY, STATE,
     look(250, 0, incarnations=(11, 99)), [Recover("ps-1 restarted (incarnation 99)")]),
    ("a ps at another epoch", POLICY, STATE, look(250, 250, epoch=4),
     [Recover("ps-0 is READY at epoch 4")]),
    ("a ps not ready", POLICY, STATE,
     Observation(now=1.0, alive=W,
                 ps=(PsSeen(11, ps_pb2.ASSIGNING, 3, 0), PsSeen(22, ps_pb2.READY, 3, 0))),
     [Recover("ps-0 is ASSIGNING at epoch 3")]),
    ("the last step: stop, no checkpoint (the final one covers it)", POLICY, STATE,
     look(1000, 1001), [Progress(1000), Stop(1000)]),
    ("no checkpoint while one is written", POLICY, STATE,
     Observation(now=1.0, ps=ready(250, 250), alive=W, checkpointing=True), [Progress(250)]),
    ("no checkpoint dir: none", Policy(steps=1000), STATE, look(250, 250), [Progress(250)]),
    ("the next multiple would be the last step: none", POLICY, STATE, look(950, 950),
     [Progress(950)]),
    ("every_seconds: due once the time has passed", Policy(steps=1000, checkpoints=True,
     every_seconds=60), STATE, look(40, 40, now=61.0), [Progress(40), Checkpoint(41)]),
    ("every_seconds: not yet", Policy(steps=1000, checkpoints=True, every_seconds=60), STATE,
     look(40, 40, now=59.0), [Progress(40)]),
    ("a worker gone", Policy(steps=1000), STATE, look(5, 5, alive=("worker-0",)),
     [Progress(5), SetWorkers(("worker-0",), gone=("worker-1",), back=())]),
    ("every worker gone: give up", Policy(steps=1000), STATE, look(5, 5, alive=()),
     [Progress(5), GiveUp("every worker is gone; giving up at step 5")]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "state", "observation", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_decide(
    policy: Policy, state: State, observation: Observation, expected: list[watch.Action]
) -> None:
    assert watch.decide(policy, state, observation)[1] == expected


def test_the_state_follows_the_workers_and_the_checkpoint_time() -> None:
    policy = Policy(steps=1000, checkpoints=True, every_seconds=60)
    state, _ = watch.decide(policy, STATE, look(5, 5, alive=("worker-0",), now=61.0))
    assert state.live == ("worker-0",)
    assert state.last_checkpoint_time == 61.0
    # back: the worker is waited for again, and no second checkpoint before 60 s more
    state, actions = watch.decide(policy, state, look(9, 9, now=100.0))
    assert actions == [Progress(9), SetWorkers(W, gone=(), back=("worker-1",))]
    assert state.live == W


def test_a_rollback_changes_nothing_the_shell_does_not_set() -> None:
    state, _ = watch.decide(POLICY, STATE, look(1, 1, incarnations=(5, 22)))
    assert state == STATE  # the shell sets the new epoch and incarnations after Recover
