"""Training speed: jaxps jobs on 127.0.0.1 against a single-process JAX loop on the same data.

Prints one JSON object per measurement (DEVELOPERS.md format). Cases: `mlp` on digits with
2 ps + 2 workers in sync and async mode, the same sync job as the user's own loop (the TF1
trainer ported in examples/programs/tf1_mnist.py, `training.program`), and the `embedding`
model (200,000-row table, rows pulled sparsely) in async mode. For each: examples per second
(ratio to the single-process loop, same model, optimizer and batch size: above 1 means the job
is faster), global steps per second, and the worker's per-step split between pull, compute and
push (measured by the workers after their first, compiling, step).

    python bench/transport.py is the transport benchmark; this one is end to end:
    python bench/training.py [--steps 600]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.process.harness

import jax
import optax
import results

from jaxps_runtime.config import training as config
from jaxps_runtime.config.mode import ModeKind
from jaxps_runtime.data import builtin as datasets
from jaxps_runtime.model import builtin as models
from tests.process import harness

BENCH = "training"
ROOT = Path(__file__).resolve().parent.parent
CASES: dict[str, dict[str, Any]] = {
    "mlp-2ps-2w-sync": {
        "model": {"name": "mlp"},
        "mode": "sync",
        "batchSize": 32,
        "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    },
    "mlp-2ps-2w-async": {
        "model": {"name": "mlp"},
        "mode": "async",
        "batchSize": 32,
        "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    },
    # The guide's TF1 trainer ported line by line (examples/programs/tf1_mnist.py): the same
    # model as mlp-2ps-2w-sync, in the user's own loop (training.program) on the session.
    "tf1-program-2ps-2w-sync": {
        "program": "tf1_mnist:main",
        "mode": "sync",
        "batchSize": 32,
        "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
    },
    "embedding-2ps-2w-async": {
        "model": {"name": "embedding"},
        "mode": "async",
        "batchSize": 64,
        "optimizer": {"name": "adagrad", "kwargs": {"learning_rate": 0.5}},
    },
}


def emit(case: str, **kwargs: Any) -> None:
    results.emit(BENCH, case, **kwargs)


def single_process(training: config.TrainingConfig, *, steps: int) -> float:
    """Examples per second of a plain jitted JAX loop (value_and_grad + optax) in one process."""
    model = models.build_model(name=training.model.name, kwargs=training.model.kwargs)
    data = datasets.build_dataset(
        name=training.dataset.name, kwargs=training.dataset.kwargs, seed=training.seed
    )
    tx = getattr(optax, training.optimizer.name)(**training.optimizer.kwargs)
    params = model.init(jax.random.PRNGKey(training.seed))
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    batches = [
        data.train_batch(worker=0, num_workers=1, step=s, batch_size=training.batchSize)
        for s in range(steps + 1)
    ]
    params, state, loss = step(params, state, batches[0])  # compile
    loss.block_until_ready()
    started = time.perf_counter()
    for batch in batches[1:]:
        params, state, loss = step(params, state, batch)
    loss.block_until_ready()
    return steps * training.batchSize / (time.perf_counter() - started)


def distributed(raw: dict[str, Any], *, workers: int, ps: int = 2) -> dict[str, Any]:
    """The summary of a local job with `ps` ps and `workers` workers training `raw`."""
    with tempfile.TemporaryDirectory(prefix="jaxps-bench-") as logs:
        programs = {"PYTHONPATH": str(ROOT / "examples" / "programs")}
        job = harness.LocalJob.start(
            training=raw, log_dir=Path(logs), ps=ps, workers=workers, extra_env=programs
        )
        try:
            codes = job.wait(timeout=900)
            if any(code != 0 for code in codes.values()):
                raise RuntimeError(f"job failed: {codes}\n{job.logs()}")
            return job.summary()
        finally:
            job.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    workers = 2
    for case, base in CASES.items():
        raw = {**base, "steps": args.steps, "logEverySeconds": 30}
        training = config.parse(raw)
        baseline = single_process(training, steps=args.steps)
        summary = distributed(raw, workers=workers)
        # Global steps per second while every worker trained (the summary's span of first
        # and last warm steps): the workers' own examples per second are counted to their last
        # heartbeat, which on a job of seconds adds up to a heartbeat of waiting to the time.
        per_step = training.batchSize * (workers if training.mode is ModeKind.SYNC else 1)
        eps = float(summary["stepsPerSecond"]) * per_step
        emit(
            case,
            metric="examples_per_second",
            value=eps,
            unit="examples/s",
            baseline="single-process-jax",
            baseline_value=baseline,
        )
        emit(
            case,
            metric="steps_per_second",
            value=eps / per_step,
            unit="steps/s",
            baseline="single-process-jax",
            baseline_value=baseline / training.batchSize,
        )
        for phase, seconds in summary["stepSeconds"].items():
            emit(case, metric=f"{phase}_seconds_per_step", value=seconds * 1e3, unit="ms")
        emit(
            case,
            metric="final_eval_" + next(iter(summary["eval"])),
            value=float(next(iter(summary["eval"].values()))),
            unit="",
        )


if __name__ == "__main__":
    main()
