"""Jobs on the user's files: MNIST-layout IDX files and a Parquet click log train to Succeeded
with `jaxps local`, a worker killed mid-run included, and every batch the job read is recorded
(a `dataset.module` wrapping jaxps' own dataset of the files) to show that the workers read the
shard queue's batches, whichever worker read them, and that no batch of the first data epoch
was left out across the restart. (That each is applied once, not read once, is
test_exactly_once's: a batch read by a worker killed before its push counts is read again.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jaxps_runtime.data.shards import ShardPlan
from tests.process import harness
from tests.process.test_local import EXAMPLES, ROOT, alive_with_job_name, jaxps_local
from tests.unit.test_filedata import write_idx

pytestmark = pytest.mark.process


def learnable_mnist(root: Path, *, train: int = 1200, test: int = 200) -> Path:
    """28x28 images whose label is drawn as a bright 4x4 block at one of ten places."""
    rng = np.random.default_rng(7)
    for split, n in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 40, (n, 28, 28), dtype=np.uint8)
        for i, label in enumerate(labels):
            row, col = divmod(int(label), 5)
            images[i, 4 + 12 * row : 8 + 12 * row, 2 + 5 * col : 6 + 5 * col] = 250
        write_idx(root / f"{split}-images-idx3-ubyte", images, gz=split == "t10k")
        write_idx(root / f"{split}-labels-idx1-ubyte", labels)
    return root


def click_log(path: Path, *, rows: int = 2000) -> Path:
    """13 dense features as a fixed-size list, and a click that depends on two of them."""
    rng = np.random.default_rng(11)
    dense = rng.standard_normal((rows, 13)).astype(np.float32)
    clicked = (dense[:, 0] + 0.5 * dense[:, 3] > 0).astype(np.int32)
    table = pa.table(
        {
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), 13),
            "clicked": pa.array(clicked),
        }
    )
    pq.write_table(table, path)
    return path


def job(
    name: str, *, model: dict[str, Any], dataset: dict[str, Any], mode: str = "async"
) -> dict[str, Any]:
    return {
        "apiVersion": "jaxps.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicaSpecs": {
                "ps": {"replicas": 1},
                "worker": {"replicas": 2, "restartPolicy": "OnFailure"},
            },
            "training": {
                "model": model,
                "dataset": dataset,
                "mode": mode,
                "steps": 600,
                "batchSize": 32,
                "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
                "checkpoint": {"dir": "checkpoints", "everySteps": 100},
                "logEverySeconds": 1,
            },
        },
    }


RECORDER = """
import json, os

from jaxps_runtime.data import builtin as datasets


class Recorder:
    \"\"\"jaxps' own dataset of the files, logging the rows of every batch read.\"\"\"

    def __init__(self, inner, log):
        self.inner, self.log = inner, log
        self.num_train = inner.num_train
        self.task = "{type}-{index}".format(**json.loads(os.environ["TF_CONFIG"])["task"])

    def examples(self, rows):
        line = {"task": self.task, "pid": os.getpid(), "ids": rows.tolist()}
        with open(self.log, "a") as out:
            out.write(json.dumps(line) + "\\n")
        return self.inner.examples(rows)

    def train_batch(self, *, worker, num_workers, step, batch_size):
        raise AssertionError("the shard queue reads batches by rows (examples)")

    def test(self):
        return self.inner.test()


def make(source, options, log):
    return Recorder(datasets.build_dataset(name=source, kwargs=options), log)
"""


def reads(log: Path) -> list[tuple[str, int, tuple[int, ...]]]:
    """(task, pid, rows) of every batch read, in the order of the log."""
    return [
        (read["task"], read["pid"], tuple(read["ids"]))
        for read in map(json.loads, log.read_text().splitlines())
    ]


@pytest.mark.parametrize("source", ["idx", "parquet"])
def test_a_job_on_files_trains_through_a_killed_worker_using_each_batch_once(
    tmp_path: Path, source: str
) -> None:
    name = f"files-{uuid.uuid4().hex[:6]}"
    if source == "idx":
        (tmp_path / "mnist").mkdir()
        model = {"name": "mlp", "kwargs": {"inputs": 784, "hidden": [32]}}
        options: dict[str, Any] = {"dir": str(learnable_mnist(tmp_path / "mnist"))}
        examples = 1200
    else:
        model = {"name": "mlp", "kwargs": {"inputs": 13, "hidden": [16], "classes": 2}}
        options = {
            "path": str(click_log(tmp_path / "clicks.parquet")),
            "columns": {"x": "dense", "y": "clicked"},
            "testFraction": 0.1,
        }
        examples = 1800  # 2000 rows, the last 10% held out
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "idsrecorder.py").write_text(RECORDER)
    log = tmp_path / "reads.jsonl"
    manifest = job(
        name,
        mode="sync" if source == "idx" else "async",  # each mode once: cursors land differently
        model=model,
        dataset={
            "module": "idsrecorder:make",
            "kwargs": {"source": source, "options": options, "log": str(log)},
        },
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(tmp_path / "mods")])}
    code, status, logs = jaxps_local(path, tmp_path, "--kill", "worker-1@step=250", env=env)
    assert code == 0, logs
    assert status["state"] == "Succeeded"
    assert status["replicaStatuses"]["worker"]["restarts"] == 1
    assert status["progress"]["step"] == 600
    assert status["progress"]["eval"]["accuracy"] >= 0.9, status["progress"]
    assert not alive_with_job_name(name)

    # Every batch read is one of the shard queue's: (data epoch, batch) -> rows, as every task
    # of the job cuts the data (training.seed 0, batchSize 32).
    plan = ShardPlan(examples=examples, batch_size=32, shard_batches=1, seed=0)
    assert plan.batches is not None
    where = {
        tuple(plan.rows(epoch, batch).tolist()): (epoch, batch)
        for epoch in range(40)  # more than a 600-step job can go through
        for batch in range(plan.batches)
    }
    read = reads(log)
    placed = [where.get(rows) for _, _, rows in read]
    assert None not in placed, "a batch read that is no batch of the shard queue's"
    # The first data epoch was read whole: no batch of it left out across the restart.
    assert {b for e, b in filter(None, placed) if e == 0} == set(range(plan.batches))
    # Both workers read, worker-1 in two lives (the kill).
    pids = {task: {pid for t, pid, _ in read if t == task} for task in ("worker-0", "worker-1")}
    assert len(pids["worker-0"]) == 1, pids
    assert len(pids["worker-1"]) == 2, pids


def test_the_mnist_example_reads_mnist_idx_files_when_they_are_there(tmp_path: Path) -> None:
    # `dir: data/mnist` is relative to where jaxps local runs: here a directory with small
    # MNIST-layout files (28x28), so the same manifest trains a 784-input MLP on them.
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    learnable_mnist(tmp_path / "data" / "mnist")
    code, status, logs = jaxps_local(EXAMPLES / "mnist.yaml", tmp_path, cwd=tmp_path)
    assert code == 0, logs
    assert status["state"] == "Succeeded"
    assert status["progress"]["eval"]["accuracy"] >= 0.9, status["progress"]
    assert "training on the built-in" not in logs
    shapes = {v["name"]: v["shape"] for v in _placement(tmp_path)["variables"]}
    assert shapes["['hidden_0']['kernel']"] == [784, 64]


def _placement(tmp_path: Path) -> dict[str, Any]:
    [manifest] = sorted((tmp_path / "work" / "checkpoints").glob("manifest-*.json"))[-1:]
    placement: dict[str, Any] = json.loads(manifest.read_text())["placement"]
    return placement


def test_the_flax_cnn_example_trains_as_it_is(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(EXAMPLES / "flax_cnn")])}
    code, status, logs = jaxps_local(EXAMPLES / "flax-cnn.yaml", tmp_path, env=env)
    assert code == 0, logs
    assert status["state"] == "Succeeded"
    assert status["progress"]["eval"]["accuracy"] >= 0.9, status["progress"]
    assert "training on the built-in 'digits' instead" in logs  # no data/mnist here


def test_the_recommender_example_learns_the_clicks(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "recommender" / "run.py"),
            "--scale",
            "0.01",
            "--rows",
            "20000",
            "--steps",
            "600",
            "--workdir",
            str(tmp_path),
        ],
        env=harness.runtime_env({}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 600
    assert result["auc"] >= 0.65, result
    # the largest table (20,000 rows here) is split over both ps; a tiny one stays whole
    assert {s["ps"] for s in result["tables"]["C1"]} == {0, 1}, result["tables"]["C1"]
    assert len(result["tables"]["C26"]) == 1
