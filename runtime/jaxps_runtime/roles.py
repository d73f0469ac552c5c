"""Which code runs a training task: worker, chief (or worker 0 without a chief), evaluator.

Exit codes: 0 done, 1 failed, 78 (`config.EXIT_INVALID_TRAINING`) when a worker, chief or
evaluator finds its training configuration invalid at start (JAXPS_TRAINING unset or refused, a
user model that does not import or build, optimizer arguments optax refuses; the problems, one
a line, also go to the termination log: `termination`), and 128 + N when signal N stopped a
worker, chief or evaluator (`stopping`): it did not finish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from jaxps_runtime.config import cluster
from jaxps_runtime.config import training as config
from jaxps_runtime.data import factory
from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.model import builtin as models
from jaxps_runtime.process import stopping, termination
from jaxps_runtime.process.metrics import Metrics
from jaxps_runtime.ps import optim
from jaxps_runtime.train import checkpoint, outcome
from jaxps_runtime.wire.credentials import TaskCredentials

if TYPE_CHECKING:
    from jaxps_runtime.train.task import Task

log = logging.getLogger(__name__)
EXIT_FAILED = 1


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
    stop: stopping.Stop,
    credentials: TaskCredentials | None = None,
) -> int:
    """Starts a worker, chief or evaluator (a ps starts in `ps.server`, before JAX loads) and
    plays its role to the end; its exit code."""
    task = spec.task
    from jaxps_runtime.train.task import Task  # noqa: PLC0415

    metrics = Metrics(task=task.name)
    if metrics_port:  # first: /healthz answers while the model and the dataset are built
        metrics.serve(metrics_port)
    try:
        try:
            training = _training(file=training_file, env=training_env)
        except config.TrainingConfigError as err:
            return _invalid_training(err.problems)
        state = Task(
            spec=spec,
            training=training,
            job_id=job_id,
            metrics=metrics,
            stop=stop,
            credentials=credentials,
        )
        where = "training" if training_file is not None else "JAXPS_TRAINING"
        try:
            with outcome.user_code("building the model and the dataset", task=task.name):
                problems = _start_problems(state, where=where)
        except outcome.JobFailure as failure:
            return _final(failure)
        if problems:
            return _invalid_training(problems)
        if not task.is_chief(spec.cluster):
            metrics.ready.set()  # the chief: once its coordinator serves
        return _play(state, bind=bind)
    except stopping.Stopped:
        log.info("%s: stopped on %s; exit code %d", task.name, stop.reason, stop.exit_code)
        return stop.exit_code
    finally:
        metrics.close()


def _start_problems(state: Task, *, where: str) -> list[str]:
    """What only JAX can find wrong with the configuration, found now rather than mid-job:
    optax's verdict on the optimizer's arguments, the user model's import and factory, the
    model's and the dataset's construction; and what TF_CONFIG's tasks cannot train
    (`config.replica_problems`: no ps, a sync step waiting for more workers than there are),
    which the operator refuses in a manifest already. Independent checks, all made."""
    cluster_spec = state.spec.cluster
    tasks = config.Replicas(
        workers=cluster_spec.num_tasks(cluster.WORKER),
        ps=cluster_spec.num_tasks(cluster.PS),
        workers_field="TF_CONFIG.cluster.worker",
        ps_field="TF_CONFIG.cluster.ps",
    )
    found = config.replica_problems(state.training, tasks, path=where)
    try:
        optim.build(state.training.optimizer, where=f"{where}.optimizer")
    except optim.OptimizerError as err:
        found.append(str(err))
    program = state.training.program
    builds: list[Callable[[], object]] = [
        # a program's variables are declared by its own code, as it runs: no model to build
        (lambda: state.model)
        if program is None
        else (lambda: factory.find(program, field=f"{where}.program")),
        lambda: state.dataset,
    ]
    for build in builds:
        try:
            build()
        except models.ModelError as err:
            if str(err) not in found:  # the mlp sizes itself from the dataset: one cause
                found.append(str(err))
    if not found and program is None:
        try:
            state.dynamic  # noqa: B018 - the dynamic tables, checked against the model
        except outcome.InvalidTrainingError as err:
            found.append(err.message)
    if not found and program is None:
        found += _batch_problems(state)
    return found


def _batch_problems(state: Task) -> list[str]:
    """The dataset's first batch, read and traced through the model's loss without computing
    it: a missing batch key or a shape the model
    does not take fails here, naming both, rather than at the first step (or never, on a
    worker that is not the first to trace)."""
    training = state.training
    try:
        plan = ShardPlan.of(state.dataset, batch_size=training.batchSize, seed=training.seed)
        batch = plan.read(state.dataset, epoch=0, batch=0)
    except models.ModelError as err:
        return [str(err)]
    shown = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in sorted(batch.items()))
    labels = models.label_problem(state.model, batch)
    if labels is not None:
        return [f"dataset {training.dataset.name!r}, its first batch: {labels}"]
    with outcome.user_code("the model's init", task=state.name):  # its error, not the data's
        shapes = state.shapes
    model = training.model.module or training.model.name
    found = _parameter_problems(shapes, model=model)
    if found:
        return found
    try:
        loss = jax.eval_shape(state.model.loss, shapes, batch)
    except Exception as err:  # whatever the model raises on these shapes
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return [
            f"model {model!r} cannot train on dataset {training.dataset.name!r}: its batches "
            f"are {{{shown}}}; {type(err).__name__}: {first}"
        ]
    if getattr(loss, "shape", None) != () or getattr(loss, "dtype", None) is None:
        return [  # jax.grad would refuse it mid-step, naming jaxps' own frame
            f"model {model!r}: its loss on a batch of dataset {training.dataset.name!r} "
            f"({{{shown}}}) is {_shape_of(loss)}; it must be a scalar (one float)"
        ]
    if not jax.numpy.issubdtype(loss.dtype, jax.numpy.floating):
        return [f"model {model!r}: its loss is of dtype {loss.dtype}; it must be a float"]
    return []


def _parameter_problems(shapes: object, *, model: str) -> list[str]:
    """A model with nothing to train (no parameters: it trained nothing and Succeeded at
    chance), or a parameter that is not a float (jax.grad refuses it at the first step,
    naming jaxps' own frame)."""
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    if not leaves:
        return [f"model {model!r} has no parameters: there is nothing to train"]
    return [
        f"model {model!r}: parameter {jax.tree_util.keystr(path)} is {_shape_of(leaf)}; "
        "every parameter must be a float (jax.grad differentiates floats only)"
        for path, leaf in leaves
        if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)
    ]


def _shape_of(value: object) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return f"a {type(value).__name__}, not an array"
    return f"{dtype}{list(shape)}"


def _final(failure: outcome.JobFailure) -> int:
    """Ends the task with a cause that ends its job (`outcome`): logged, in the termination
    log for the control plane, and its exit code (`config.FINAL_EXITS`)."""
    log.error("%s: %s", failure.reason, failure.message, exc_info=failure.__cause__ is not None)
    termination.write([failure.message])
    return failure.exit_code


def _invalid_training(problems: Sequence[str]) -> int:
    for problem in problems:
        log.error("%s", problem)
    termination.write(problems)
    return config.EXIT_INVALID_TRAINING


def _play(state: Task, *, bind: str | None) -> int:
    """Runs the task's role to its end; its exit code. Raises `Stopped` once told to stop,
    whatever the role's calls raised on the way out."""
    from jaxps_runtime.train import chief, evaluator, program, worker  # noqa: PLC0415

    spec, stop = state.spec, state.stop
    task = spec.task
    try:
        stop.check()
        if state.training.program is not None:  # the user's own loop, on every task
            return program.run(state, bind=bind)
        if task.type == cluster.CHIEF:
            return chief.Chief(state, trains=False, bind=bind).run()
        if task.type == cluster.WORKER and task.is_chief(spec.cluster):
            return chief.Chief(state, trains=True, bind=bind).run()
        if task.type == cluster.WORKER:
            return worker.run(state)
        return evaluator.run(state)
    except outcome.JobFailure as failure:
        stop.check()
        return _final(failure)
    except (TimeoutError, checkpoint.CheckpointError) as err:
        stop.check()
        log.error("%s", err)
        return EXIT_FAILED
    except Exception:
        stop.check()  # a stopping task's calls fail on the way out: that is no failure
        log.exception("%s failed", task.name)
        return EXIT_FAILED
