"""The mode is read once into a `TrainingMode`; `wire_mode` is the one place it becomes the
proto's, and the manifest's fields come back from it as they were given."""

from __future__ import annotations

import pytest

from jaxps.v1 import parameter_server_pb2 as ps_pb2
from jaxps_runtime.config import training as config
from jaxps_runtime.config.mode import ModeKind, TrainingMode
from jaxps_runtime.wire import terms


@pytest.mark.parametrize(
    ("raw", "mode"),
    [
        pytest.param({}, TrainingMode(ModeKind.ASYNC), id="async-by-default"),
        pytest.param(
            {"mode": "sync", "replicasToAggregate": 3},
            TrainingMode(ModeKind.SYNC, replicas_to_aggregate=3),
            id="sync",
        ),
        pytest.param(
            {"mode": "boundedStaleness"},
            TrainingMode(ModeKind.BOUNDED_STALENESS, max_staleness=2),
            id="bounded-staleness-2-by-default",
        ),
    ],
)
def test_the_mode_is_read_once_into_one_value(raw: dict[str, object], mode: TrainingMode) -> None:
    training = config.parse(raw)
    assert training.training_mode == mode
    assert training.mode == raw.get("mode", "async")  # the kind is the manifest's string
    assert config.parse(mode.to_manifest()).training_mode == mode  # read back as it was


@pytest.mark.parametrize(
    ("mode", "wire"),
    [
        pytest.param(
            TrainingMode(ModeKind.SYNC),
            terms.Mode(kind=ps_pb2.SYNC, replicas_to_aggregate=0, max_staleness=2, last_step=9),
            id="sync-every-live-worker",
        ),
        pytest.param(
            TrainingMode(ModeKind.SYNC, replicas_to_aggregate=3),
            terms.Mode(kind=ps_pb2.SYNC, replicas_to_aggregate=3, max_staleness=2, last_step=9),
            id="sync-3",
        ),
        pytest.param(
            TrainingMode(ModeKind.ASYNC),
            terms.Mode(kind=ps_pb2.ASYNC, max_staleness=2, last_step=9),
            id="async",
        ),
        pytest.param(
            TrainingMode(ModeKind.BOUNDED_STALENESS, max_staleness=4),
            terms.Mode(kind=ps_pb2.BOUNDED_STALENESS, max_staleness=4, last_step=9),
            id="bounded-staleness",
        ),
    ],
)
def test_wire_mode_is_what_an_init_sends(mode: TrainingMode, wire: terms.Mode) -> None:
    assert terms.wire_mode(mode, last_step=9) == wire


def test_every_kind_has_its_wire_kind() -> None:
    assert {terms.wire_mode(TrainingMode(kind), last_step=1).kind for kind in ModeKind} == {
        ps_pb2.SYNC,
        ps_pb2.ASYNC,
        ps_pb2.BOUNDED_STALENESS,
    }
