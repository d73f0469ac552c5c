"""Datasets from the user's files: IDX and named arrays, memory-mapped, sharded and resumable
as the built-ins; every problem named before training."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from jaxps_runtime import roles
from jaxps_runtime.config import cluster
from jaxps_runtime.config import training as config
from jaxps_runtime.config.catalog import ModelError
from jaxps_runtime.data import arrays
from jaxps_runtime.data import builtin as datasets
from jaxps_runtime.data import files as filedata
from jaxps_runtime.data.shards import ShardPlan
from jaxps_runtime.process.metrics import Metrics
from jaxps_runtime.train.task import Task
from tests.unit.test_roles import WORKER_1, _start


def write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> None:
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}[array.dtype]
    header = bytes([0, 0, code, array.ndim]) + b"".join(n.to_bytes(4, "big") for n in array.shape)
    data = header + array.tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def mnist_dir(root: Path, *, train: int = 40, test: int = 10, side: int = 4) -> Path:
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, (n, side, side), dtype=np.uint8)
        images[:, 0, 0] = np.arange(n) % 256  # pixel (0, 0) is the example's id
        write_idx(root / f"{split}-images-idx3-ubyte", images, gz=split == "t10k")
        write_idx(root / f"{split}-labels-idx1-ubyte", (np.arange(n) % 10).astype(np.uint8))
    return root


def test_idx_files_read_as_scaled_pixels_memory_mapped_gzipped_or_not(tmp_path: Path) -> None:
    data = datasets.build_dataset(name="idx", kwargs={"dir": str(mnist_dir(tmp_path))}, seed=3)
    batch = data.train_batch(worker=0, num_workers=2, step=0, batch_size=8)
    assert batch["x"].dtype == np.float32
    assert batch["x"].shape == (8, 16)
    assert 0.0 <= batch["x"].min() <= batch["x"].max() <= 1.0
    assert batch["y"].dtype == np.int32
    ids = np.rint(batch["x"][:, 0] * 255).astype(int)
    assert all(i % 2 == 0 for i in ids)  # worker 0 of 2 reads its shard only
    assert np.array_equal(batch["y"], ids % 10)  # images and labels stay paired
    mapped = filedata.idx_arrays(str(tmp_path), where="w")["train"]["x"]
    assert isinstance(mapped.base, np.memmap)  # a view of the file, not a copy in memory
    assert data.test()["x"].shape == (10, 16)  # t10k: gzipped, read into memory


def test_a_workers_batches_are_the_same_after_a_restart_and_never_overlap(tmp_path: Path) -> None:
    root = str(mnist_dir(tmp_path, train=60))
    first = datasets.build_dataset(name="idx", kwargs={"dir": root}, seed=1)
    again = datasets.build_dataset(name="idx", kwargs={"dir": root}, seed=1)
    for step in (0, 5, 11):  # across epochs (30 rows per worker, 8 per batch)
        a = first.train_batch(worker=1, num_workers=2, step=step, batch_size=8)
        b = again.train_batch(worker=1, num_workers=2, step=step, batch_size=8)
        assert np.array_equal(a["x"], b["x"])
    seen = [
        set(
            np.rint(
                first.train_batch(worker=w, num_workers=2, step=0, batch_size=30)["x"][:, 0] * 255
            ).astype(int)
        )
        for w in (0, 1)
    ]
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 60  # one epoch of each worker covers its shard exactly


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda d: (d / "train-labels-idx1-ubyte").unlink(), "no train-labels-idx1-ubyte"),
        (lambda d: (d / "train-images-idx3-ubyte").write_bytes(b"PK\x03\x04"), "not an IDX file"),
        (
            lambda d: (d / "train-images-idx3-ubyte").write_bytes(
                (d / "train-images-idx3-ubyte").read_bytes()[:100]
            ),
            "the file is cut short",
        ),
    ],
    ids=["missing-file", "not-idx", "truncated"],
)
def test_a_broken_mnist_directory_is_named_with_the_file(
    tmp_path: Path, break_it: object, message: str
) -> None:
    root = mnist_dir(tmp_path)
    break_it(root)  # type: ignore[operator]
    with pytest.raises(ModelError, match=message) as caught:
        datasets.build_dataset(name="idx", kwargs={"dir": str(root)})
    assert str(caught.value).startswith("dataset.kwargs.dir: ")
    with pytest.raises(ModelError, match="is not a directory"):
        datasets.build_dataset(name="idx", kwargs={"dir": str(tmp_path / "nope")})


def test_named_arrays_from_npz_or_npy_with_keys_and_a_test_split(tmp_path: Path) -> None:
    x = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
    labels = np.arange(50, dtype=np.int32)
    np.savez(tmp_path / "data.npz", images=x, labels=labels)
    np.savez_compressed(tmp_path / "packed.npz", images=x, labels=labels)
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "images.npy", x)
    np.save(tmp_path / "dir" / "labels.npy", labels)
    for source in ("data.npz", "packed.npz", "dir"):
        data = datasets.build_dataset(
            name="arrays",
            kwargs={"path": str(tmp_path / source), "keys": {"x": "images", "y": "labels"}},
        )
        batch = data.train_batch(worker=0, num_workers=1, step=0, batch_size=5)
        assert set(batch) == {"x", "y"}
        assert np.array_equal(batch["x"][:, 0] / 3, batch["y"])  # rows stay paired
        assert list(data.test()["y"]) == list(range(40, 50))  # the last 20% by default
    stored = filedata.array_files(str(tmp_path / "data.npz"), where="w")
    assert isinstance(stored["images"], np.memmap)  # stored members are not read whole
    held = datasets.build_dataset(
        name="arrays",
        kwargs={"path": str(tmp_path / "data.npz"), "test": str(tmp_path / "dir")},
    )
    assert len(held.test()["labels"]) == 50


def test_array_problems_name_the_field_and_the_file(tmp_path: Path) -> None:
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 2)), y=np.zeros(5))
    cases: list[tuple[dict[str, Any], str]] = [
        ({}, "dataset.kwargs.path: expected the path of a file or directory"),
        ({"path": str(tmp_path / "none.npz")}, "none.npz: no such file"),
        ({"path": str(tmp_path / "data.npz")}, "the arrays differ in rows"),
        (
            {"path": str(tmp_path / "data.npz"), "keys": {"x": "pixels"}},
            "dataset.kwargs.keys: .* has no array 'pixels'; it has x, y",
        ),
        ({"path": str(tmp_path), "keys": {"x": 3}}, "dataset.kwargs.keys: expected an object"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ModelError, match=message):
            datasets.build_dataset(name="arrays", kwargs=kwargs)
    # a test file narrower than the training file: the mlp sized itself from one, and the
    # other was blamed on model.kwargs.inputs, a field the user never set
    np.savez(tmp_path / "train10.npz", x=np.zeros((8, 10), np.float32), y=np.zeros(8, np.int32))
    np.savez(tmp_path / "test9.npz", x=np.zeros((4, 9), np.float32), y=np.zeros(4, np.int32))
    narrow = {"path": str(tmp_path / "train10.npz"), "test": str(tmp_path / "test9.npz")}
    with pytest.raises(ModelError, match=r"dataset.kwargs.test: .*test9.npz's 'x' is float32\[9\]"):
        datasets.build_dataset(name="arrays", kwargs=narrow)
    # a 0-d array raised TypeError ("len() of unsized object"), blamed on the user's code
    np.savez(tmp_path / "scalar.npz", x=np.zeros((4, 2)), y=np.float32(3.0))
    with pytest.raises(ModelError, match=r"array 'y' is a single value \(0-d\)"):
        datasets.build_dataset(name="arrays", kwargs={"path": str(tmp_path / "scalar.npz")})


def test_a_dataset_problem_found_by_the_model_and_the_dataset_is_said_once(
    tmp_path: Path, termination_log: Path
) -> None:
    """The mlp sizes itself from the dataset: both builds met the same problem, and the
    Failed message said it twice."""
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 4), np.float32), y=np.zeros(0, np.int32))
    training = {"dataset": {"name": "arrays", "kwargs": {"path": str(tmp_path / "empty.npz")}}}
    assert _start(json.dumps(training)) == config.EXIT_INVALID_TRAINING
    lines = termination_log.read_text().splitlines()
    assert len(lines) == len(set(lines)) >= 1, lines


def test_a_shape_the_model_does_not_take_fails_at_start_naming_both(
    tmp_path: Path, termination_log: Path
) -> None:
    (tmp_path / "m").mkdir()
    training = {
        "model": {"name": "mlp", "kwargs": {"inputs": 64}},  # the 8x8 digits' width
        "dataset": {"name": "idx", "kwargs": {"dir": str(mnist_dir(tmp_path / "m"))}},
    }
    assert _start(json.dumps(training)) == config.EXIT_INVALID_TRAINING
    line = termination_log.read_text()
    assert "model 'mlp' cannot train on dataset 'idx'" in line
    assert "x: float32[32, 16]" in line


def test_a_dataset_smaller_than_one_batch_and_than_the_workers_still_trains(
    tmp_path: Path,
) -> None:
    # Any worker reads any batch of the shard queue's (`data.shards`): two workers and one
    # training example are no problem at start, and each epoch is one partial batch.
    np.savez(
        tmp_path / "one.npz",
        x=np.array([[3.0], [5.0]], np.float32),
        y=np.array([1.0, 2.0], np.float32),
    )
    training = config.parse(
        {
            "model": {"name": "linear", "kwargs": {"features": 1}},
            "dataset": {
                "name": "arrays",
                "kwargs": {"path": str(tmp_path / "one.npz"), "testFraction": 0.5},
            },
        },
        path="JAXPS_TRAINING",
    )
    spec = cluster.from_env({"TF_CONFIG": json.dumps(WORKER_1)})
    assert spec is not None
    assert spec.cluster.num_tasks(cluster.WORKER) == 2
    state = Task(spec=spec, training=training, job_id="job", metrics=Metrics(task=spec.task.name))
    assert roles._start_problems(state, where="JAXPS_TRAINING") == []
    plan = ShardPlan.of(state.dataset, batch_size=training.batchSize, seed=training.seed)
    assert training.batchSize > 1
    assert (plan.examples, plan.batches, plan.shards) == (1, 1, 1)
    for epoch in (0, 1, 2):
        batch = plan.read(state.dataset, epoch=epoch, batch=0)
        assert batch["x"].tolist() == [[3.0]]  # the one training row, every epoch
        assert batch["y"].tolist() == [1.0]
    params = state.model.init(jax.random.PRNGKey(training.seed))
    loss, grads = jax.value_and_grad(state.model.loss)(params, batch)
    assert np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))


USER_DATA = """
import numpy as np

def arrays(rows=20):
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    return {"train": {"x": x, "y": x[:, 0]}, "test": {"x": x[:4], "y": x[:4, 0]}}

class Stream:
    def train_batch(self, *, worker, num_workers, step, batch_size):
        return {"x": np.full((batch_size, 2), step, np.float32)}
    def test(self):
        return {"x": np.zeros((3, 2), np.float32)}

def stream():
    return Stream()

def ragged():
    return {"train": {"x": np.zeros((3, 2)), "y": np.zeros(2)}, "test": {"x": np.zeros(1)}}

def nothing():
    return [1, 2]
"""


@pytest.fixture
def user_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_data.py").write_text(USER_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_data"


def test_a_user_dataset_module_gives_arrays_jaxps_shards_or_its_own_batches(
    user_data: str,
) -> None:
    data = datasets.build_dataset(name="x", module=f"{user_data}:arrays", kwargs={"rows": 30})
    assert isinstance(data, arrays.ArrayDataset)
    a = data.train_batch(worker=1, num_workers=2, step=3, batch_size=4)
    assert all(int(v) % 2 == 1 for v in a["x"][:, 0] / 2)  # worker 1's shard: odd rows
    b = datasets.build_dataset(name="x", module=f"{user_data}:arrays", kwargs={"rows": 30})
    assert np.array_equal(a["x"], b.train_batch(worker=1, num_workers=2, step=3, batch_size=4)["x"])
    own = datasets.build_dataset(name="x", module=f"{user_data}:stream")
    assert own.train_batch(worker=0, num_workers=1, step=7, batch_size=2)["x"][0, 0] == 7


@pytest.mark.parametrize(
    ("module", "kwargs", "message"),
    [
        ("{m}:ragged", None, "the train arrays differ in rows"),
        ("{m}:nothing", None, "returned a list; expected"),
        ("{m}:arrays", {"colums": 3}, "dataset.kwargs: {m}:arrays refused them"),
        ("{m}:missing", None, "dataset.module: '{m}:missing': '{m}' has no attribute"),
        ("no_such_data:make", None, "dataset.module: 'no_such_data:make': cannot import"),
    ],
    ids=["ragged", "not-arrays", "bad-kwargs", "no-factory", "no-module"],
)
def test_a_user_dataset_that_does_not_fit_is_named(
    user_data: str, module: str, kwargs: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(ModelError, match=message.format(m=user_data)):
        datasets.build_dataset(name="x", module=module.format(m=user_data), kwargs=kwargs)


def test_the_configuration_takes_a_dataset_module_with_any_kwargs() -> None:
    parsed = config.parse({"dataset": {"module": "pkg.data:make", "kwargs": {"anything": 1}}})
    assert parsed.dataset.module == "pkg.data:make"
    assert parsed.dataset.kwargs == {"anything": 1}
    with pytest.raises(config.TrainingConfigError, match=r"dataset\.module"):
        config.parse({"dataset": {"module": "not a module"}})


def test_parquet_columns_become_batch_keys_lists_become_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 40
    table = pa.table(
        {
            "clicked": pa.array(np.arange(n) % 2, pa.int32()),
            "dense": pa.FixedSizeListArray.from_arrays(
                pa.array(np.arange(n * 3, dtype=np.float32)), 3
            ),
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "note": pa.array([f"row {i}" for i in range(n)]),
        }
    )
    pq.write_table(table, tmp_path / "clicks.parquet")
    data = datasets.build_dataset(
        name="parquet",
        kwargs={
            "path": str(tmp_path / "clicks.parquet"),
            "columns": {"x": "dense", "y": "clicked", "id": "id"},
        },
    )
    batch = data.train_batch(worker=0, num_workers=2, step=0, batch_size=6)
    assert batch["x"].shape == (6, 3)
    assert np.array_equal(batch["x"][:, 0], batch["id"] * 3)  # columns stay paired by row
    assert np.array_equal(batch["y"], batch["id"] % 2)
    assert list(data.test()["id"]) == list(range(32, 40))
    with pytest.raises(ModelError, match="column 'note' is string; expected numbers"):
        datasets.build_dataset(name="parquet", kwargs={"path": str(tmp_path / "clicks.parquet")})
    with pytest.raises(ModelError, match=r"dataset\.kwargs\.columns: .* has no column 'label'"):
        datasets.build_dataset(
            name="parquet",
            kwargs={"path": str(tmp_path / "clicks.parquet"), "columns": {"y": "label"}},
        )
    with pytest.raises(ModelError, match="no such file or directory"):
        datasets.build_dataset(name="parquet", kwargs={"path": str(tmp_path / "none.parquet")})
    with_nulls = pa.table({"y": pa.array([1.0, None, 2.0])})
    pq.write_table(with_nulls, tmp_path / "nulls.parquet")
    with pytest.raises(ModelError, match="column 'y' has 1 null values"):
        datasets.build_dataset(name="parquet", kwargs={"path": str(tmp_path / "nulls.parquet")})
