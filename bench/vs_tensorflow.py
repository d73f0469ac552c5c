"""jaxps against TensorFlow's own parameter-server runtime: the same work, same run, same machine.

Every case runs on 2 ps + 2 workers on 127.0.0.1 with worker 0 as chief, both ways, alternating
(TensorFlow, jaxps, TensorFlow, jaxps, ...) `--rounds` times. Both sides train the same model
from the very same initial values, with Adagrad as TensorFlow's distributed example
(`initial_accumulator_value=0.1`; optax's `eps=0` makes it TF1's ApplyAdagrad), the same batch
size and number of global steps, on the very same batches: round r uses seed r, and this
script writes that seed's parameters (`model.init`) and batches to a file the TensorFlow tasks
read. TensorFlow runs TF1-style between-graph replication with
`tf.compat.v1` (bench/tf/task.py); jaxps runs `LocalJob`, as `jaxps local` does.

Cases, latency-bound: `mlp-sync`, `mlp-async` (`mlp` with one hidden layer of 64 on digits,
4,810 parameters) and `embedding-async` (`embedding`, a 200,000 x 16 table read sparsely).
Bandwidth-bound:
- `dense-sync`, `dense-async`: `mlp` with hidden [2048, 2048] on digits (64 -> 2048 -> 2048 ->
  10, 4.35M parameters, 17.4 MB); batch 64, learning rate 0.05, 150 sync steps (each of both
  workers' batches) or 300 async ones: the same examples, about 13 epochs, ~0.95 test accuracy.
  Both systems split a variable of more than 256 KiB along axis 0 into min(ps, rows,
  bytes // 256 KiB) parts (client.placement; bench/tf/task.py gives TensorFlow the same
  parts with `fixed_size_partitioner`, which for these shapes is also what its
  `min_max_variable_partitioner` would choose): both kernels are cut in two, one half per ps,
  so a worker step pulls and pushes about 8.7 MB on each ps, on both sides.
- `embedding-big-async`: `embedding` with a 4,000,000 x 16 table (256 MB, half on each ps) on
  `sparse` ids drawn from all its rows (`idRange` 4,000,000); batch 256 of 4 ids, learning rate
  0.5. A step moves only the rows its batch uses (jaxps pads them to 1,024, 64 KB; TensorFlow
  reads by `embedding_lookup`, pushes IndexedSlices): it measures holding, initialising and
  serving a big table rather than bandwidth.
`largest_ps_parameter_bytes` checks that both placed the same bytes on the fuller ps.

Per case it prints (one JSON object per line); against TensorFlow, jaxps as users run it (mutual
TLS between every task), and the same metrics with the suffix `_plaintext` for jaxps without:
- `steps_per_second`: the median global steps per second while every worker trained (from the
  end of each worker's first step, which compiles or places the graph, to the first worker's
  last step; jaxps's chief reports it as `stepsPerSecond`); `ratio` = jaxps / TensorFlow.
- `test_accuracy`: the median final test accuracy over the rounds (over seeds 0 .. rounds-1),
  so speed is compared at equal quality. One seed's accuracy is not a verdict: the test sets are
  small (digits: 360 examples, one is 0.28 points), and the same run stopped a step earlier or
  later moves by a point. In sync mode jaxps takes exactly the synchronous steps (the mean of
  both workers' gradients of their k-th batches, on the parameters of step k:
  tests/process/test_training.py), which TensorFlow computes too when it runs them in one
  process; its SyncReplicasOptimizer does not: a worker starts its second batch before the first
  step is applied (the chief queues a token per worker at the start), and the accumulators drop
  a gradient that arrives after its step was applied, so its run on the same seed ends
  elsewhere, higher on some seeds and lower on others.
- `job_seconds`: the median wall time from starting the processes to the last worker's exit.
- `job_cpu_seconds`: the median CPU time (user + system) of all the job's processes together,
  start-up included: the work each system needs for the same training, which on a machine
  with few cores (every task shares them) bounds its speed.
- `steps_per_second_tls`, `job_seconds_tls`: jaxps with mutual TLS between every task (as the
  operator and `jaxps local` run it) against jaxps in plaintext (`--insecure`), same run; the
  ratio is the cost of TLS (1.0: none); `steps_per_second_tls_paired`: the median over rounds
  of each round's TLS / plaintext steps per second, which the drift of a shared machine between
  rounds does not move. Without `--tf-python` only these are measured.

    make bench-tf       (builds .venv-tf with the pinned tensorflow-cpu, then runs this)
    python bench/vs_tensorflow.py --tf-python .venv-tf/bin/python [--rounds 3] [--cases mlp-sync]
    python bench/vs_tensorflow.py [--rounds 3]      (TLS against plaintext only)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.process.harness

import jax
import numpy as np
import results

from jaxps_runtime.client import placement
from jaxps_runtime.config import catalog, cluster
from jaxps_runtime.config import training as config
from jaxps_runtime.data import builtin as datasets
from jaxps_runtime.data.arrays import ArrayDataset, Dataset
from jaxps_runtime.model import builtin as models
from jaxps_runtime.train.timing import overlap_steps_per_second
from tests.process import harness

BENCH = "vs_tensorflow"
HERE = Path(__file__).resolve().parent
PS, WORKERS = 2, 2
CASES: dict[str, dict[str, Any]] = {
    "mlp-sync": {
        "model": {"name": "mlp", "kwargs": {"hidden": [64]}},
        "dataset": {"name": "digits"},
        "mode": "sync",
        "steps": 600,
        "batchSize": 32,
        "learning_rate": 0.1,
    },
    "mlp-async": {
        "model": {"name": "mlp", "kwargs": {"hidden": [64]}},
        "dataset": {"name": "digits"},
        "mode": "async",
        "steps": 1200,
        "batchSize": 32,
        "learning_rate": 0.1,
    },
    "embedding-async": {
        "model": {"name": "embedding", "kwargs": {"rows": 200_000, "dim": 16}},
        "dataset": {"name": "sparse"},
        "mode": "async",
        "steps": 1200,
        "batchSize": 64,
        "learning_rate": 0.5,
    },
    # Bandwidth-bound: 4.35M parameters, a ~8.7 MB pull and push per ps per worker step.
    "dense-sync": {
        "model": {"name": "mlp", "kwargs": {"hidden": [2048, 2048]}},
        "dataset": {"name": "digits"},
        "mode": "sync",
        "steps": 150,
        "batchSize": 64,
        "learning_rate": 0.05,
    },
    "dense-async": {
        "model": {"name": "mlp", "kwargs": {"hidden": [2048, 2048]}},
        "dataset": {"name": "digits"},
        "mode": "async",
        "steps": 300,
        "batchSize": 64,
        "learning_rate": 0.05,
    },
    # A 256 MB table (4M rows) over ids drawn from all of it: the ps hold and initialise it,
    # a step moves only the rows its batch uses.
    "embedding-big-async": {
        "model": {"name": "embedding", "kwargs": {"rows": 4_000_000, "dim": 16}},
        "dataset": {"name": "sparse", "kwargs": {"idRange": 4_000_000}},
        "mode": "async",
        "steps": 2000,
        "batchSize": 256,
        "learning_rate": 0.5,
    },
}
INITIAL_ACCUMULATOR = 0.1


def jaxps_training(case: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """The TrainingJob `spec.training` of a case, with `seed` (initial values, data split and
    batch order)."""
    return {
        "seed": seed,
        "model": case["model"],
        "dataset": case["dataset"],
        "mode": case["mode"],
        "steps": case["steps"],
        "batchSize": case["batchSize"],
        "optimizer": {
            "name": "adagrad",
            "kwargs": {
                "learning_rate": case["learning_rate"],
                "initial_accumulator_value": INITIAL_ACCUMULATOR,
                "eps": 0.0,
            },
        },
        "logEverySeconds": 30,
    }


def tf_case(case: dict[str, Any]) -> dict[str, Any]:
    """What bench/tf/task.py needs to build the same model and training."""
    kwargs = case["model"]["kwargs"]
    return {
        "model": case["model"]["name"],
        "hidden": kwargs.get("hidden", []),
        "rows": kwargs.get("rows", 0),
        "dim": kwargs.get("dim", 0),
        "ps": PS,
        "min_shard_bytes": catalog.DEFAULT_MIN_SHARD_BYTES,
        "mode": case["mode"],
        "steps": case["steps"],
        "learning_rate": case["learning_rate"],
        "initial_accumulator_value": INITIAL_ACCUMULATOR,
    }


def built(
    case: dict[str, Any], seed: int = 0
) -> tuple[config.TrainingConfig, Dataset, models.Model]:
    """The case's training with `seed`, its dataset and its model, as a jaxps task builds them."""
    training = config.parse(jaxps_training(case, seed))
    data = datasets.build_dataset(
        name=training.dataset.name, kwargs=training.dataset.kwargs, seed=training.seed
    )
    model = models.build_model(
        name=training.model.name, kwargs=training.model.kwargs, example=data.test
    )
    return training, data, model


def jaxps_ps_bytes(case: dict[str, Any]) -> list[int]:
    """The bytes of the model's parameters jaxps places on each ps (not the optimizer state)."""
    training, _, model = built(case)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(training.seed))
    return placement.plan(
        placement.variables_of(shapes),
        num_ps=PS,
        strategy=training.placement.strategy,
        min_shard_bytes=training.placement.minShardBytes,
    ).bytes_per_ps()


def write_batches(case: dict[str, Any], path: Path, seed: int) -> None:
    """The dataset; per worker and local step, the rows jaxps's worker reads then; and the
    parameters jaxps starts from (`init/<variable path>`), which TensorFlow starts from too."""
    training, data, model = built(case, seed)
    assert isinstance(data, ArrayDataset)
    order = np.stack(
        [
            np.stack(
                [
                    data.train_indices(
                        worker=w, num_workers=WORKERS, step=s, batch_size=training.batchSize
                    )
                    for s in range(training.steps)  # async: a worker may do all the steps
                ]
            )
            for w in range(WORKERS)
        ]
    )
    train, test = data._train, data.test()
    arrays: dict[str, Any] = {"order": order, **train}
    arrays |= {f"test_{k}": v for k, v in test.items()}
    arrays |= {
        "init/" + "/".join(str(getattr(key, "key", key)) for key in keys): np.asarray(value)
        for keys, value in jax.tree_util.tree_flatten_with_path(
            model.init(jax.random.PRNGKey(training.seed))
        )[0]
    }
    np.savez(path, **arrays)


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of every child process this one has waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_tensorflow(python: str, case: dict[str, Any], data: Path, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True)
    cpu = children_cpu_seconds()
    ports = cluster.free_ports(PS + WORKERS)
    spec = {
        "ps": [f"127.0.0.1:{p}" for p in ports[:PS]],
        "worker": [f"127.0.0.1:{p}" for p in ports[PS:]],
    }
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for job, count in (("ps", PS), ("worker", WORKERS)):
            for i in range(count):
                name = f"{job}-{i}"
                with open(work / f"tf-{name}.log", "wb") as log:
                    procs[name] = subprocess.Popen(
                        [
                            python,
                            str(HERE / "tf" / "task.py"),
                            f"--cluster={json.dumps(spec)}",
                            f"--job={job}",
                            f"--index={i}",
                            f"--case={json.dumps(tf_case(case))}",
                            f"--data={data}",
                            f"--out={work / f'tf-{name}.json'}",
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
        for i in range(WORKERS):
            code = procs[f"worker-{i}"].wait(timeout=900)
            if code != 0:
                log_text = (work / f"tf-worker-{i}.log").read_text()[-3000:]
                raise RuntimeError(f"TensorFlow worker {i} exited with {code}:\n{log_text}")
        seconds = time.monotonic() - started
    finally:
        for proc in procs.values():  # the ps tasks never exit on their own
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    reports = [json.loads((work / f"tf-worker-{i}.json").read_text()) for i in range(WORKERS)]
    return {
        "steps_per_second": overlap_steps_per_second([tuple(r["span"]) for r in reports]),
        "accuracy": reports[0]["accuracy"],
        "job_seconds": seconds,
        "job_cpu_seconds": children_cpu_seconds() - cpu,  # every task exited and was waited for
        "ps_bytes": reports[0]["ps_bytes"],
    }


def run_jaxps(case: dict[str, Any], work: Path, *, tls: bool, seed: int) -> dict[str, Any]:
    cpu = children_cpu_seconds()
    started = time.monotonic()
    job = harness.LocalJob.start(
        training=jaxps_training(case, seed), log_dir=work, ps=PS, workers=WORKERS, tls=tls
    )
    try:
        codes = job.wait(timeout=900)
        seconds = time.monotonic() - started
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"jaxps job failed: {codes}\n{job.logs()}")
        summary = job.summary()
    finally:
        job.stop()
    return {
        "steps_per_second": float(summary["stepsPerSecond"]),
        "accuracy": float(summary["eval"]["accuracy"]),
        "job_seconds": seconds,
        "job_cpu_seconds": children_cpu_seconds() - cpu,
        "step_split_ms": {k: v * 1e3 for k, v in summary["stepSeconds"].items()},
    }


def progress(run: dict[str, Any]) -> str:
    return f"{run['steps_per_second']:.1f} steps/s, test accuracy {run['accuracy']:.4f}"


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(run[key]) for run in runs)


def tf_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import tensorflow as tf; print(tf.__version__)"],
        check=True,
        capture_output=True,
        text=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tf-python", help="python of the TensorFlow venv (without: TLS against plaintext only)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of each system per case")
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), default=list(CASES))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: got {args.rounds}; expected 1 or more")
    baseline = f"tensorflow-{tf_version(args.tf_python)}-tf1-ps" if args.tf_python else None
    for name in args.cases:
        case = CASES[name]
        runs: dict[str, list[dict[str, Any]]] = {"tf": [], "jaxps": [], "tls": []}
        with tempfile.TemporaryDirectory(prefix="jaxps-vs-tf-") as tmp:
            work = Path(tmp)
            for r in range(args.rounds):
                # Round r: seed r on both sides (the same initial values and batches).
                if args.tf_python:
                    data = work / f"batches-{r}.npz"
                    write_batches(case, data, seed=r)
                    runs["tf"].append(run_tensorflow(args.tf_python, case, data, work / f"tf-{r}"))
                runs["jaxps"].append(run_jaxps(case, work / f"jaxps-{r}", tls=False, seed=r))
                runs["tls"].append(run_jaxps(case, work / f"tls-{r}", tls=True, seed=r))
                print(
                    f"{name} round {r + 1}/{args.rounds} (seed {r}): "
                    + (f"tf {progress(runs['tf'][-1])}, " if runs["tf"] else "")
                    + f"jaxps {progress(runs['jaxps'][-1])}, "
                    f"with TLS {progress(runs['tls'][-1])}",
                    file=sys.stderr,
                    flush=True,
                )
        for metric, unit, lower in (
            ("steps_per_second", "steps/s", False),
            ("job_seconds", "s", True),
        ):
            results.emit(
                BENCH,
                name,
                metric=f"{metric}_tls",
                value=median(runs["tls"], metric),
                unit=unit,
                baseline="jaxps-plaintext",
                baseline_value=median(runs["jaxps"], metric),
                lower_is_better=lower,
            )
        # The same, paired: rounds run back to back, so each round's TLS run is set against the
        # plaintext run just before it, and the machine's drift between rounds (other load, CPU
        # frequency) cancels out; the median over rounds of those ratios.
        paired = statistics.median(
            t["steps_per_second"] / p["steps_per_second"]
            for t, p in zip(runs["tls"], runs["jaxps"], strict=True)
        )
        results.emit(
            BENCH,
            name,
            metric="steps_per_second_tls_paired",
            value=paired,
            unit="ratio",
            baseline="jaxps-plaintext, same round",
            baseline_value=1.0,
        )
        if not runs["tf"]:
            continue

        # jaxps as users run it (mutual TLS, on by default) against TensorFlow (plaintext: its
        # runtime has no TLS between tasks), then jaxps in plaintext beside it.
        for suffix, side in (("", "tls"), ("_plaintext", "jaxps")):
            for metric, unit, lower in (
                ("steps_per_second", "steps/s", False),
                ("accuracy", "", False),
                ("job_seconds", "s", True),
                ("job_cpu_seconds", "s", True),
            ):
                results.emit(
                    BENCH,
                    name,
                    metric=(metric if metric != "accuracy" else "test_accuracy") + suffix,
                    value=median(runs[side], metric),
                    unit=unit,
                    baseline=baseline,
                    baseline_value=median(runs["tf"], metric),
                    lower_is_better=lower,
                )
        # Equal work: the parameter bytes on the fuller ps (what a dense step pulls and pushes
        # there per worker), as jaxps places them and as TensorFlow's graph did.
        results.emit(
            BENCH,
            name,
            metric="largest_ps_parameter_bytes",
            value=max(jaxps_ps_bytes(case)),
            unit="bytes",
            baseline=baseline,
            baseline_value=max(runs["tf"][0]["ps_bytes"]),
            lower_is_better=True,
        )
        for phase in ("pull", "compute", "push"):
            results.emit(
                BENCH,
                name,
                metric=f"jaxps_{phase}_ms_per_step",
                value=statistics.median(run["step_split_ms"][phase] for run in runs["jaxps"]),
                unit="ms",
            )


if __name__ == "__main__":
    main()
