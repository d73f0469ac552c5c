"""The user's own training loop: `training.program: "package.module:main"`, run on the chief and
every worker (and evaluator), each with the task's TF_CONFIG. `main()` declares the variables
and opens a session; what the session is depends on the task, as TensorFlow's
`MonitoredTrainingSession(is_chief=...)` does:

    from jaxps_runtime.train import program

    def main() -> None:
        variables = {"w": np.zeros((64, 10), np.float32), "b": np.zeros(10, np.float32)}
        with program.session(variables, evaluate=accuracy) as sess:
            while not sess.should_stop():
                batch = sess.next_batch()      # or the loop's own data
                if batch is None:
                    continue
                params = sess.params()         # the variables' pytree at the global step
                loss, grads = grad(params, batch)
                sess.push_tree(grads, loss=loss)

- on a worker: a `session.Session` (pull, push, the global step, recovery, draining);
- on the chief task: the chief's run of the job (it initialises the ps tier from the declared
  values or restores the last checkpoint, coordinates, checkpoints, writes summaries, records
  the outcome); the session it returns is over at once (`should_stop()` is True);
- on worker 0 of a job without a chief task: the chief's run in a thread, and worker 0's
  session for the loop, as TensorFlow's chief worker both coordinates and trains;
- on an evaluator: the evaluation of each checkpoint's step with `evaluate` (params, the
  dataset's held-out batch -> {metric: value}), then a session over at once.
Every task must declare the same variables (names, shapes, dtypes: the placement is computed
from them on every task); the chief's values are the initial ones. Variables are placed on the
ps tasks by `training.placement` and updated there by `training.optimizer`; `tables`
({variable: batch key of its row ids}) are embedding tables read by rows.

A worker's loop runs until `should_stop()` says training is over: a program that returns before
(its session not trained to the end, the task not told to stop) or calls `sys.exit(0)` is a
`UserCodeError`. On worker 0, once the chief's run has the job's outcome, the loop has
`LOOP_GRACE_SECONDS` to return; a loop stuck in its own code ends the process with that outcome.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import jax
import numpy as np

from jaxps_runtime.client import placement
from jaxps_runtime.config import cluster
from jaxps_runtime.config.training import OptimizerConfig, TrainingConfig
from jaxps_runtime.data import factory
from jaxps_runtime.data.arrays import Dataset
from jaxps_runtime.process import stopping, termination
from jaxps_runtime.ps import optim
from jaxps_runtime.train import evaluator, outcome
from jaxps_runtime.train.chief import Chief
from jaxps_runtime.train.session import Session
from jaxps_runtime.train.task import Task

log = logging.getLogger(__name__)
# How long worker 0's loop has to return once the job's outcome is known (`should_stop`);
# JAXPS_LOOP_GRACE_SECONDS sets another (`cluster.seconds_setting`, checked at task start)
LOOP_GRACE_SECONDS = 30.0

Evaluate = Callable[[Any, Mapping[str, Any]], Mapping[str, Any]]

_current: dict[str, Any] = {}  # the task whose program runs in this process (one per process)


class Declared:
    """The variables a program declared, as the task's model: `init` gives their values (the
    chief initialises the ps tier with them); there is no loss: the loop computes gradients."""

    def __init__(
        self,
        variables: Any,
        *,
        tables: Mapping[str, str] | None,
        evaluate: Evaluate | None,
        optimizers: Mapping[str, Any] | None = None,
    ) -> None:
        self._values = jax.tree_util.tree_map(np.asarray, variables)
        self.sparse: Mapping[str, str] = MappingProxyType(dict(tables or {}))
        self._evaluate = evaluate
        leaves = placement.named_leaves(self._values)[1]
        if not leaves:  # a sync step would wait for gradients no worker can push
            raise ValueError("program.session: no variables (an empty tree): nothing to train")
        for name, value in leaves.items():
            if not jax.numpy.issubdtype(np.asarray(value).dtype, jax.numpy.floating):
                raise ValueError(
                    f"program.session: variable {name} is {np.asarray(value).dtype}"
                    f"{list(np.shape(value))}; every variable must be a float array (the ps "
                    "optimizer updates floats only)"
                )
        names = list(leaves)
        self.optimizers = own_optimizers(names, optimizers or {})

    def init(self, key: jax.Array) -> Any:
        return self._values

    def loss(self, params: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
        raise TypeError("a program's variables have no loss: its own loop computes gradients")

    def evaluate(self, params: Any, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        if self._evaluate is None:
            return {}
        return dict(self._evaluate(params, batch))


def own_optimizers(
    names: Sequence[str], optimizers: Mapping[str, Any]
) -> dict[str, OptimizerConfig]:
    """{variable name: optimizer} of `optimizers` ({"generator": {"name": ..., "kwargs": ...}}:
    a part of the variables' tree, "a/b" for a deeper one, to an optimizer as in
    `training.optimizer`); a variable under two of them takes the deeper one's."""
    by_prefix: dict[str, OptimizerConfig] = {}
    for path, raw in optimizers.items():
        where = f"program.session(optimizers)[{path!r}]"
        prefix = "".join(f"[{part!r}]" for part in str(path).split("/"))
        if not any(_under(name, prefix) for name in names):
            raise ValueError(f"{where}: names no variable; the variables: {', '.join(names)}")
        config = (
            raw if isinstance(raw, OptimizerConfig) else OptimizerConfig.from_dict(raw, where=where)
        )
        optim.build(config, where=where)
        by_prefix[prefix] = config
    out: dict[str, OptimizerConfig] = {}
    for name in names:
        under = [prefix for prefix in by_prefix if _under(name, prefix)]
        if under:
            out[name] = by_prefix[max(under, key=len)]
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + "[")


class Hook(Protocol):
    """Called after each push of the session's loop (TensorFlow's `SessionRunHook.after_run`):
    `step` is the global step the gradients were computed at, `applied` whether they counted."""

    def after_step(self, session: Session, *, step: int, loss: float, applied: bool) -> None: ...


@dataclass
class LoggingHook:
    """Logs the loss every `every_steps` global steps (TensorFlow's `LoggingTensorHook`)."""

    every_steps: int = 100

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"LoggingHook.every_steps: got {self.every_steps}; expected >= 1")

    def after_step(self, session: Session, *, step: int, loss: float, applied: bool) -> None:
        if applied and step % self.every_steps == 0:
            log.info("%s: global step %d, loss %.6g", session.task.name, step, loss)


class Hooked(Session):
    """A worker's session that calls `hooks` after each push."""

    def __init__(self, task: Task, *, hooks: Sequence[Hook]) -> None:
        super().__init__(task)
        self.hooks = tuple(hooks)

    def push(self, grads: Mapping[str, Any], **kwargs: Any) -> bool:
        step = self.global_step
        applied = super().push(grads, **kwargs)
        for hook in self.hooks:
            hook.after_step(self, step=step, loss=self.loss, applied=applied)
        return applied


class Over:
    """The session of a task that does not train (the chief, an evaluator): over at once."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.global_step = task.training.steps
        self.over = True

    def __enter__(self) -> Over:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def should_stop(self) -> bool:
        return True

    # the worker's calls, for a loop that makes them anyway: nothing to train here
    def next_batch(self) -> None:
        return None

    def params(self) -> dict[str, Any]:
        return {}

    def pull(self, *_: object, **__: object) -> dict[str, np.ndarray]:
        return {}

    def push(self, *_: object, **__: object) -> bool:
        return False

    def push_tree(self, *_: object, **__: object) -> bool:
        return False


def _task() -> Task:
    task: Task | None = _current.get("task")
    if task is None:
        raise RuntimeError(
            "jaxps_runtime.train.program: no task here; call it from the function "
            "training.program names, which `python -m jaxps_runtime` runs on each task of the job"
        )
    return task


def training() -> TrainingConfig:
    """The job's `spec.training` (steps, batchSize, seed, mode, ...)."""
    return _task().training


def dataset() -> Dataset:
    """The job's dataset (`training.dataset`): what `Session.next_batch` reads through the
    chief's shard queue; its `test()` split is what `evaluate` is given."""
    return _task().dataset


def session(
    variables: Any,
    *,
    tables: Mapping[str, str] | None = None,
    evaluate: Evaluate | None = None,
    hooks: Sequence[Hook] = (),
    optimizers: Mapping[str, Any] | None = None,
) -> Session | Over:
    """Declares the job's variables (a pytree of arrays) and opens this task's session (see
    the module's doc), whose pushes call `hooks` on a worker. `optimizers`: parts of the tree
    with an optimizer of their own on the ps (`own_optimizers`), every other variable is
    updated by `training.optimizer`. Once per process, from the function `training.program`
    names."""
    task = _task()
    if _current.get("declared"):
        raise RuntimeError("program.session: called twice; a task opens one session")
    task.model = Declared(variables, tables=tables, evaluate=evaluate, optimizers=optimizers)
    _current["declared"] = True
    role = task.spec.task
    if role.type in (cluster.CHIEF, cluster.EVALUATOR):  # its run follows the program's
        return Over(task)
    opened = Hooked(task, hooks=hooks)
    _current["session"] = opened
    if role.is_chief(task.spec.cluster):  # worker 0 of a job without a chief task
        _current["chief"] = _ChiefThread(task, bind=_current.get("bind"), session=opened)
    return opened


def run(task: Task, *, bind: str | None) -> int:
    """Runs the task's program (`training.program`) to its end; its exit code: the chief's or
    the evaluator's, 0 for a worker whose loop ended."""
    where = "training.program"
    target = factory.find(task.training.program or "", field=where)
    _current.clear()
    _current.update(task=task, bind=bind)
    try:
        try:
            with _user_loop(task):
                target()
        finally:
            ended: _ChiefThread | None = _current.get("chief")
            if ended is not None:
                ended.loop_ended.set()
        if not _current.get("declared"):
            raise outcome.UserCodeError(
                f"{task.name}: {where} {task.training.program!r} returned without opening a "
                "session (jaxps_runtime.train.program.session)"
            )
        opened: Session | None = _current.get("session")
        if opened is not None and not opened.trained and not task.stop.is_set:
            raise outcome.UserCodeError(
                f"{task.name}: {where} {task.training.program!r} left its session at step "
                f"{opened.global_step}, before training ended (training.steps "
                f"{task.training.steps}): its loop must run until session.should_stop() is True"
            )
        chief: _ChiefThread | None = _current.get("chief")
        if chief is not None:
            return chief.result()
        role = task.spec.task.type
        if role == cluster.CHIEF:
            return Chief(task, trains=False, bind=bind).run()
        if role == cluster.EVALUATOR:
            return evaluator.run(task)
        return 0
    except BaseException as err:
        running: _ChiefThread | None = _current.get("chief")
        if running is None:
            raise
        running.worker_failed(err)  # the chief's run reports how worker 0's loop ended
        code = running.result()
        if isinstance(err, stopping.Stopped):
            raise
        return code
    finally:
        _current.clear()


@contextmanager
def _user_loop(task: Task) -> Iterator[None]:
    """The program's own code: what it raises is the user's (`UserCodeError`), except what
    the session raises for the job (`JobFailure`) and a stop (`Stopped`)."""
    with outcome.user_code(f"training.program {task.training.program!r}", task=task.name):
        yield


class _ChiefThread:
    """The chief's run of the job in a thread, beside worker 0's loop in the main thread (a
    job without a chief task). If the chief's run ends first (it failed), the loop is stopped;
    if the loop fails, the chief's run reports it (`WorkerZero.check`)."""

    def __init__(self, task: Task, *, bind: str | None, session: Session) -> None:
        self._task, self._session = task, session
        self._error: BaseException | None = None
        self._loop_error: BaseException | None = None
        self._code = 0
        self.loop_ended = threading.Event()  # set once the program returned or raised
        self._chief = Chief(task, trains=True, bind=bind, worker_zero=self)
        self._thread = threading.Thread(target=self._run, name="chief", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._code = self._chief.run()
        except BaseException as err:
            self._error = err
        finally:  # the loop ends too (it is over, or the chief failed: no one coordinates)
            self._session.link.finished.set()
        self._end_if_the_loop_does_not()

    def _end_if_the_loop_does_not(self) -> None:
        """The job has its outcome: the loop, told so by `should_stop`, has `LOOP_GRACE_SECONDS`
        to return; a loop stuck in its own code (or never asking) would keep the process, and
        the job, running forever, so the process ends with the chief's outcome."""
        grace = cluster.seconds_setting(os.environ.get(cluster.LOOP_GRACE_ENV, ""))
        grace = LOOP_GRACE_SECONDS if grace is None else grace
        if self.loop_ended.wait(grace) or isinstance(self._error, stopping.Stopped):
            return
        code = self._code
        if isinstance(self._error, outcome.JobFailure):
            log.error("%s: %s", self._error.reason, self._error.message)
            termination.write([self._error.message])
            code = self._error.exit_code
        elif self._error is not None:
            log.error("%s: the chief failed: %r", self._task.name, self._error)
            code = 1
        log.error(
            "%s: training.program did not return within %.0f s of the job's end (its loop "
            "runs while not session.should_stop()); exiting with code %d",
            self._task.name,
            grace,
            code,
        )
        logging.shutdown()
        os._exit(code)

    # what the chief's run calls on worker 0 (`chief.job.WorkerZero`)
    def start(self) -> None:
        return None  # the loop runs already, in the main thread

    def check(self) -> None:
        err = self._loop_error
        if err is None or isinstance(err, stopping.Stopped):
            return
        if isinstance(err, outcome.JobFailure):
            raise err
        raise RuntimeError(f"worker-0 failed: {type(err).__name__}: {err}") from err

    def join(self, timeout: float | None = None) -> None:
        return None  # the loop is the main thread's: it ended before `result` joins the chief

    def worker_failed(self, err: BaseException) -> None:
        self._loop_error = err

    def result(self) -> int:
        """Waits for the chief's run to end; its exit code, or what it raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._code
