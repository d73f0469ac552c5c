"""Scaling: examples and steps per second for 1, 2 and 4 workers with 1 and 2 ps, next to the
same model trained by one JAX process (the ceiling: no distribution at all).

Prints one JSON object per measurement (DEVELOPERS.md format); `ratio` is the job's examples
per second over the single process's (above 1: the job is faster). Models: `mlp` on digits
(latency-bound: 4,810 parameters) and `dense` (hidden [2048, 2048], 4.3M parameters, 17 MB each
way per step: bandwidth-bound). Async mode, so every worker's batch is one step.

    python bench/scaling.py [--steps 400] [--dense-steps 60] [--models mlp,dense]
"""

from __future__ import annotations

import argparse
from typing import Any

import results
from training import distributed, single_process

from jaxps_runtime.config import training as config

BENCH = "scaling"
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"model": {"name": "mlp", "kwargs": {"hidden": [64]}}, "batchSize": 32},
    "dense": {"model": {"name": "mlp", "kwargs": {"hidden": [2048, 2048]}}, "batchSize": 64},
}
GRID = [(ps, workers) for ps in (1, 2) for workers in (1, 2, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps of the mlp jobs")
    parser.add_argument("--dense-steps", type=int, default=60, help="steps of the dense jobs")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    for name in args.models.split(","):
        steps = args.dense_steps if name == "dense" else args.steps
        raw = {
            **MODELS[name],
            "mode": "async",
            "steps": steps,
            "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.001}},
            "logEverySeconds": 30,
        }
        training = config.parse(raw)
        ceiling = single_process(training, steps=steps)
        results.emit(
            BENCH,
            name,
            metric="single_process_examples_per_second",
            value=ceiling,
            unit="examples/s",
        )
        for ps, workers in GRID:
            summary = distributed(raw, workers=workers, ps=ps)
            eps = float(summary["examplesPerSecond"])
            case = f"{name}-{ps}ps-{workers}w"
            results.emit(
                BENCH,
                case,
                metric="examples_per_second",
                value=eps,
                unit="examples/s",
                baseline="single-process-jax",
                baseline_value=ceiling,
            )
            results.emit(
                BENCH,
                case,
                metric="steps_per_second",
                value=eps / training.batchSize,
                unit="steps/s",
                baseline="single-process-jax",
                baseline_value=ceiling / training.batchSize,
            )


if __name__ == "__main__":
    main()
