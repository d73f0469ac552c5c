"""A task that finds its training configuration invalid at start exits 78 (EX_CONFIG), leaving
the problems in its termination log, where Kubernetes would read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jaxps_runtime.config import training as config
from jaxps_runtime.process import termination
from tests.process import harness

pytestmark = pytest.mark.process


@pytest.mark.parametrize(
    ("training", "message"),
    [
        pytest.param(
            {"optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.1, "mu_dtype": "nope"}}},
            'JAXPS_TRAINING.optimizer.kwargs.mu_dtype: got "nope"; expected null',
            id="optimizer-kwargs-a-dtype",
        ),
        pytest.param(
            {"model": {"name": "mine", "module": "no_such_pkg.models:make"}},
            "model.module: 'no_such_pkg.models:make': cannot import 'no_such_pkg.models'",
            id="user-module-missing",
        ),
    ],
)
def test_a_worker_with_an_invalid_training_exits_78_with_its_termination_log(
    tmp_path: Path, training: dict[str, Any], message: str
) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")  # as the kubelet creates it
    job = harness.LocalJob.start(
        training=training,
        log_dir=tmp_path / "logs",
        ps=1,
        workers=2,
        order=["worker-1"],  # not the chief: nothing else needs to run
        task_env={"worker-1": {termination.ENV: str(log)}},
    )
    try:
        codes = job.wait(timeout=120)
    finally:
        job.stop()
    assert codes == {"worker-1": config.EXIT_INVALID_TRAINING}, job.logs()
    assert message in log.read_text()
    assert message in job.logs()
