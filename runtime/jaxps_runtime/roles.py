"""Which code runs a task: ps, worker, chief (or worker 0 without a chief), evaluator.

Exit codes: 0 done, 1 failed, 2 bad input (the training configuration or the model's).
"""

from __future__ import annotations

import logging
from pathlib import Path

from jaxps_runtime import checkpoint, cluster, config, models, server
from jaxps_runtime.metrics import Metrics

log = logging.getLogger(__name__)
EXIT_FAILED, EXIT_USAGE = 1, 2


def _training(*, file: Path | None, env: str | None) -> config.TrainingConfig:
    if file is not None:
        return config.load(file)
    if env is None:
        raise config.TrainingConfigError(
            "JAXPS_TRAINING: not set; a worker, chief or evaluator needs the training "
            "configuration (JAXPS_TRAINING as JSON, or --training FILE)"
        )
    return config.loads(env, path="JAXPS_TRAINING")


def run(
    *,
    spec: cluster.TFConfig,
    job_id: str,
    bind: str | None,
    training_file: Path | None,
    training_env: str | None,
    metrics_port: int,
) -> int:
    task = spec.task
    if task.type == cluster.PS:
        return server.serve_ps(
            address=spec.cluster.address(task),
            job_id=job_id,
            task=task.name,
            bind=bind,
            metrics_port=metrics_port,
        )
    from jaxps_runtime import chief, evaluator, worker  # noqa: PLC0415
    from jaxps_runtime.task import Task  # noqa: PLC0415

    try:
        training = _training(file=training_file, env=training_env)
        state = Task(spec=spec, training=training, job_id=job_id, metrics=Metrics(task=task.name))
        state.model  # noqa: B018 - build the model and the data now: errors surface at start
        state.dataset  # noqa: B018
    except (config.TrainingConfigError, models.ModelError) as err:
        log.error("%s", err)
        return EXIT_USAGE
    if metrics_port:
        state.metrics.serve(metrics_port)
    try:
        if task.type == cluster.CHIEF:
            return chief.Chief(state, trains=False, bind=bind).run()
        if task.type == cluster.WORKER and task.is_chief(spec.cluster):
            return chief.Chief(state, trains=True, bind=bind).run()
        if task.type == cluster.WORKER:
            return worker.run(state)
        return evaluator.run(state)
    except (TimeoutError, checkpoint.CheckpointError) as err:
        log.error("%s", err)
        return EXIT_FAILED
    except Exception:
        log.exception("%s failed", task.name)
        return EXIT_FAILED
