"""The recommender example end to end: generate a Criteo-layout click log, train Wide & Deep on
it with `jaxps local` (2 ps, 2 workers, async, the embedding tables read sparsely), and report
AUC, steps per second and where the embedding tables were placed across the ps.

    python examples/recommender/run.py                 # 2M-row largest table, 200k clicks
    python examples/recommender/run.py --scale 0.01    # a quick run: every table 100x smaller
    python examples/recommender/run.py --hashed        # raw 64-bit ids, dynamic tables

The log has Criteo's columns: `label`, `I1`..`I13` (counts) and `C1`..`C26` (categorical ids,
Zipf-distributed over each column's cardinality). Clicks follow a hidden logistic model of the
dense features and of per-id scores, so a model that learns the embeddings finds signal.

`--hashed`: each categorical value is a 64-bit hash of (column, value), as a production log
has it, with no vocabulary: every table is a dynamic one (`training.embeddings`) of at most
half its column's distinct values (`--max-rows-share`), admitted on first sight and evicted
least recently used; the model's tables are declared 2 rows (their rows are the ps's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from sklearn.metrics import roc_auc_score

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from wide_deep import CARDINALITIES, CATEGORICAL, DENSE  # noqa: E402

ZIPF = 1.1
TEST_FRACTION = 0.1  # the held-out tail of the log


def hashed(column: int, ids: np.ndarray) -> np.ndarray:
    """A 64-bit hash of (column, id) for each id: any int64, negative ones included."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) ^ (np.uint64(column + 1) << np.uint64(40))
        z = (z + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))).view(np.int64)


def click_log(
    path: Path, *, rows: int, cardinalities: list[int], seed: int = 0, hash_ids: bool = False
) -> tuple[float, float]:
    """Writes the log as Parquet; returns its click rate and the AUC the hidden model itself
    scores on the held-out tail (the ceiling: no model can rank the clicks better)."""
    rng = np.random.default_rng(seed)
    columns: dict[str, np.ndarray] = {}
    logit = np.full(rows, -1.6)
    for i, name in enumerate(DENSE):
        counts = np.floor(rng.lognormal(mean=0.5 + 0.2 * i, sigma=1.2, size=rows))
        counts[rng.random(rows) < 0.2] = 0  # many zero counts, as in Criteo
        columns[name] = counts.astype(np.int32)
        logit += rng.normal(0, 0.25) * (np.log1p(counts) - np.log1p(counts).mean())
    for name, cardinality in zip(CATEGORICAL, cardinalities, strict=True):
        weights = np.arange(1, cardinality + 1, dtype=np.float64) ** -ZIPF
        cdf = np.cumsum(weights / weights.sum())
        ranks = np.minimum(np.searchsorted(cdf, rng.random(rows)), cardinality - 1)
        ids = rng.permutation(cardinality)[ranks].astype(np.int64)
        columns[name] = hashed(CATEGORICAL.index(name), ids) if hash_ids else ids
        logit += rng.normal(0, 0.35, cardinality)[ids]  # each id's hidden effect
    clicked = rng.random(rows) < 1 / (1 + np.exp(-logit))
    table = pa.table({"label": clicked.astype(np.int32), **columns})
    pq.write_table(table, path)
    test = slice(rows - round(TEST_FRACTION * rows), rows)
    return float(clicked.mean()), float(roc_auc_score(clicked[test], logit[test]))


def manifest(
    *, log: Path, cardinalities: list[int], steps: int, max_rows: list[int] | None = None
) -> dict:
    """The job; with `max_rows` (one per column), every table a dynamic one of that bound."""
    job = {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "wide-deep"},
        "spec": {
            "replicaSpecs": {"ps": {"replicas": 2}, "worker": {"replicas": 2}},
            "training": {
                "model": {
                    "name": "wide-deep",
                    "module": "wide_deep:make",
                    "kwargs": {"cardinalities": cardinalities, "dim": 8, "hidden": [64, 32]},
                },
                "dataset": {
                    "name": "parquet",
                    "kwargs": {"path": str(log), "testFraction": TEST_FRACTION},
                },
                "mode": "async",
                "steps": steps,
                "batchSize": 256,
                "optimizer": {"name": "adagrad", "kwargs": {"learning_rate": 0.05}},
                "checkpoint": {"dir": "checkpoints", "everySteps": steps},
                "logEverySeconds": 5,
            },
        },
    }
    if max_rows is not None:
        training = job["spec"]["training"]
        training["model"]["kwargs"]["cardinalities"] = [2] * len(CATEGORICAL)
        training["embeddings"] = {
            column: {"dim": 9, "maxRows": bound, "eviction": "lru"}
            for column, bound in zip(CATEGORICAL, max_rows, strict=True)
        }
    return job


def placement_of_tables(workdir: Path) -> dict[str, list[dict]]:
    """Each table's shards (ps, rows, MB) as the job placed them: from its checkpoint."""
    [found] = sorted((workdir / "checkpoints").glob("manifest-*.json"))[-1:]
    placement = json.loads(found.read_text())["placement"]
    shapes = {v["name"]: v["shape"] for v in placement["variables"]}
    tables: dict[str, list[dict]] = {}
    for shard in placement["shards"]:
        name = shard["variable"]
        column = name.strip("[]'")
        if column not in CATEGORICAL:
            continue
        rows = shard["stop"] - shard["start"]
        tables.setdefault(column, []).append(
            {
                "ps": shard["ps"],
                "rows": [shard["start"], shard["stop"]],
                "mb": round(rows * shapes[name][1] * 4 / 1e6, 2),
            }
        )
    return dict(sorted(tables.items(), key=lambda kv: -sum(s["mb"] for s in kv[1])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="click log rows")
    parser.add_argument("--scale", type=float, default=1.0, help="table sizes times this")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--hashed", action="store_true", help="raw 64-bit ids and dynamic tables")
    parser.add_argument(
        "--max-rows-share",
        type=float,
        default=0.5,
        help="--hashed: each table's maxRows, a share of its column's distinct values",
    )
    args = parser.parse_args(argv)
    name = "wide-deep-hashed" if args.hashed else "wide-deep"
    args.workdir = args.workdir or ROOT / ".work" / name
    args.workdir.mkdir(parents=True, exist_ok=True)
    cardinalities = [max(2, round(c * args.scale)) for c in CARDINALITIES]
    log = args.workdir / "clicks.parquet"
    started = time.monotonic()
    rate, ceiling = click_log(
        log, rows=args.rows, cardinalities=cardinalities, hash_ids=args.hashed
    )
    batch = 256
    # each column's distinct values in the log (no more than its cardinality: a Zipf tail)
    distinct = [len(np.unique(c)) for c in pq.read_table(log, columns=CATEGORICAL).columns]
    max_rows = (
        [max(batch, round(n * args.max_rows_share)) for n in distinct] if args.hashed else None
    )
    print(
        f"click log: {args.rows} rows, click rate {rate:.3f}, tables {cardinalities[:4]}..., "
        f"{log} ({time.monotonic() - started:.0f} s)",
        flush=True,
    )
    path = args.workdir / "wide-deep.yaml"
    path.write_text(
        yaml.safe_dump(
            manifest(log=log, cardinalities=cardinalities, steps=args.steps, max_rows=max_rows)
        )
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "operator"), str(ROOT / "runtime")]),
    }
    command = [sys.executable, "-m", "jaxps_operator", "local", str(path), "--json"]
    run = subprocess.run(
        [*command, "--workdir", str(args.workdir / "job")],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    status = json.loads(run.stdout) if run.stdout.strip().startswith("{") else {}
    if run.returncode != 0 or status.get("state") != "Succeeded":
        print(f"the job did not succeed (exit {run.returncode}): {status.get('state')}")
        return 1
    progress = status["progress"]
    result = {
        "auc": round(progress["eval"]["auc"], 4),
        "accuracy": round(progress["eval"]["accuracy"], 4),
        "clickRate": round(rate, 4),
        "ceilingAuc": round(ceiling, 4),
        "steps": progress["step"],
        "stepsPerSecond": progress.get("stepsPerSecond"),
        "examplesPerSecond": round(progress.get("stepsPerSecond", 0) * 256, 1),
        "tables": {} if args.hashed else placement_of_tables(args.workdir / "job"),
        "hashed": args.hashed,
        "distinctIds": sum(distinct),
        **({"maxRows": sum(max_rows)} if max_rows else {}),
    }
    print("embedding tables across the ps (largest first):")
    for column, shards in result["tables"].items():
        parts = ", ".join(f"ps-{s['ps']} rows {s['rows'][0]}-{s['rows'][1]}" for s in shards)
        print(f"  {column:>4} {sum(s['mb'] for s in shards):8.2f} MB  {parts}")
    print(
        f"AUC {result['auc']} (the generating model's own: {result['ceilingAuc']}; accuracy "
        f"{result['accuracy']}, click rate {result['clickRate']}); "
        f"{result['stepsPerSecond']} steps/s, {result['examplesPerSecond']} examples/s"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
