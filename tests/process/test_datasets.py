"""Jobs on the user's files: MNIST-layout IDX files and a Parquet click log train to Succeeded
with `jaxps local`, a worker killed mid-run included."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.process.test_local import alive_with_job_name, jaxps_local
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


def job(name: str, *, model: dict[str, Any], dataset: dict[str, Any]) -> dict[str, Any]:
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
                "mode": "async",
                "steps": 600,
                "batchSize": 32,
                "optimizer": {"name": "adam", "kwargs": {"learning_rate": 0.01}},
                "checkpoint": {"dir": "checkpoints", "everySteps": 100},
                "logEverySeconds": 1,
            },
        },
    }


@pytest.mark.parametrize("source", ["idx", "parquet"])
def test_a_job_on_files_trains_through_a_killed_worker(tmp_path: Path, source: str) -> None:
    name = f"files-{uuid.uuid4().hex[:6]}"
    if source == "idx":
        (tmp_path / "mnist").mkdir()
        manifest = job(
            name,
            model={"name": "mlp", "kwargs": {"inputs": 784, "hidden": [32]}},
            dataset={"name": "idx", "kwargs": {"dir": str(learnable_mnist(tmp_path / "mnist"))}},
        )
    else:
        manifest = job(
            name,
            model={"name": "mlp", "kwargs": {"inputs": 13, "hidden": [16], "classes": 2}},
            dataset={
                "name": "parquet",
                "kwargs": {
                    "path": str(click_log(tmp_path / "clicks.parquet")),
                    "columns": {"x": "dense", "y": "clicked"},
                },
            },
        )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    code, status, logs = jaxps_local(path, tmp_path, "--kill", "worker-1@step=250")
    assert code == 0, logs
    assert status["state"] == "Succeeded"
    assert status["replicaStatuses"]["worker"]["restarts"] == 1
    assert status["progress"]["step"] == 600
    assert status["progress"]["eval"]["accuracy"] >= 0.9, status["progress"]
    assert not alive_with_job_name(name)
