"""Jobs on the user's files: MNIST-layout IDX files and a Parquet click log train to Succeeded
with `jaxps local`, a worker killed mid-run included, and every batch a worker trained on is
recorded (a `dataset.module` wrapping jaxps' own dataset of the files) to show that none was
used twice or left out across the restart."""

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
        self.task = "{type}-{index}".format(**json.loads(os.environ["TF_CONFIG"])["task"])

    def train_batch(self, *, worker, num_workers, step, batch_size):
        rows = self.inner.train_indices(
            worker=worker, num_workers=num_workers, step=step, batch_size=batch_size
        )
        line = {"task": self.task, "pid": os.getpid(), "worker": worker, "step": step,
                "ids": rows.tolist()}
        with open(self.log, "a") as out:
            out.write(json.dumps(line) + "\\n")
        return self.inner.train_batch(
            worker=worker, num_workers=num_workers, step=step, batch_size=batch_size
        )

    def test(self):
        return self.inner.test()


def make(source, options, log):
    return Recorder(datasets.build_dataset(name=source, kwargs=options), log)
"""


def reads_by_life(log: Path, worker: int) -> list[list[tuple[int, list[int]]]]:
    """(step, example ids) of each batch worker `worker` trained on, one list per process.
    Every task reads worker 0's first batch once as it starts (its start-up check of the
    batch against the model), before any training: that read is left out."""
    lives: dict[int, list[tuple[int, list[int]]]] = {}
    checked: set[int] = set()
    for line in log.read_text().splitlines():
        read = json.loads(line)
        if read["pid"] not in checked:
            checked.add(read["pid"])
            continue
        if read["task"] == f"worker-{worker}":
            assert read["worker"] == worker, read
            lives.setdefault(read["pid"], []).append((read["step"], read["ids"]))
    return list(lives.values())


@pytest.mark.parametrize("source", ["idx", "parquet"])
def test_a_job_on_files_trains_through_a_killed_worker_using_each_batch_once(
    tmp_path: Path, source: str
) -> None:
    name = f"files-{uuid.uuid4().hex[:6]}"
    if source == "idx":
        (tmp_path / "mnist").mkdir()
        model = {"name": "mlp", "kwargs": {"inputs": 784, "hidden": [32]}}
        options: dict[str, Any] = {"dir": str(learnable_mnist(tmp_path / "mnist"))}
        shard = 1200 // 2
    else:
        model = {"name": "mlp", "kwargs": {"inputs": 13, "hidden": [16], "classes": 2}}
        options = {
            "path": str(click_log(tmp_path / "clicks.parquet")),
            "columns": {"x": "dense", "y": "clicked"},
            "testFraction": 0.1,
        }
        shard = 1800 // 2
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "idsrecorder.py").write_text(RECORDER)
    reads = tmp_path / "reads.jsonl"
    manifest = job(
        name,
        mode="sync" if source == "idx" else "async",  # each mode once: cursors land differently
        model=model,
        dataset={
            "module": "idsrecorder:make",
            "kwargs": {"source": source, "options": options, "log": str(reads)},
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

    per_epoch = shard // 32  # whole batches in a worker's first pass over its shard
    first_epoch: list[set[int]] = []
    for worker in (0, 1):
        lives = reads_by_life(reads, worker)
        assert len(lives) == (2 if worker == 1 else 1), [len(life) for life in lives]
        # Each life reads its batches in order, none twice, none left out; the first from 0.
        for life in lives:
            steps = [step for step, _ in life]
            assert steps == list(range(steps[0], steps[0] + len(steps))), steps
        assert lives[0][0][0] == 0
        if worker == 1:
            before, after = lives
            last, resumed = before[-1][0], after[0][0]
            # The restart goes on right after the last batch whose gradient reached the ps:
            # the batch it was killed on is read again only if its push never counted.
            assert resumed in (last, last + 1), (last, resumed)
            if resumed == last:
                assert after[0][1] == before[-1][1]  # the very same examples
        ids: dict[int, list[int]] = {}
        for life in lives:
            for step, rows in life:
                assert ids.setdefault(step, rows) == rows  # a batch is a function of its step
        assert len(ids) >= per_epoch, len(ids)
        epoch = [row for step in range(per_epoch) for row in ids[step]]
        assert len(set(epoch)) == len(epoch)  # no example twice within a pass over the shard
        first_epoch.append(set(epoch))
    assert not first_epoch[0] & first_epoch[1]  # the workers' shards do not overlap


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
