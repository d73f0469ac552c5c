"""Built-in models and datasets, user models by module path, and errors that name the field."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest

from jaxps_runtime.config import catalog
from jaxps_runtime.data import arrays
from jaxps_runtime.data import builtin as datasets
from jaxps_runtime.model import builtin as models
from tests.unit.test_filedata import mnist_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "user_model"
SMALL_SPARSE = {"examples": 2000, "testExamples": 200}
_W0 = {"worker": 0, "num_workers": 2, "step": 0, "batch_size": 32}


@pytest.fixture
def user_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """`examples/user_model` and `tmp_path` on sys.path; the modules imported from them are
    forgotten afterwards."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("quadratic", "usermod"):
        sys.modules.pop(name, None)


def _dataset_for(model: str) -> arrays.Dataset:
    kwargs = SMALL_SPARSE if model == "embedding" else None
    return datasets.build_dataset(name=catalog.DEFAULT_DATASET[model], kwargs=kwargs, seed=3)


def _equal_trees(a: Any, b: Any) -> bool:
    """Same structure (else tree.map raises) and equal leaves."""
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def _train(
    model: models.Model,
    batches: list[list[arrays.Batch]],
    *,
    tx: optax.GradientTransformation,
    key: int = 0,
) -> tuple[Any, list[float]]:
    """Synchronous data parallelism in one process: each step averages the gradients of the
    step's batches (one per worker) and applies `tx`. Returns the parameters and the losses."""
    params = model.init(jax.random.key(key))
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any, group: list[arrays.Batch]) -> tuple[Any, Any, jax.Array]:
        losses, grads = zip(
            *(jax.value_and_grad(model.loss)(params, b) for b in group), strict=True
        )
        mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        updates, state = tx.update(mean, state, params)
        return optax.apply_updates(params, updates), state, sum(losses) / len(losses)

    history = []
    for group in batches:
        params, state, loss = step(params, state, group)
        history.append(float(loss))
    return params, history


@pytest.mark.parametrize("name", catalog.MODELS)
def test_init_is_deterministic_for_a_key(name: str) -> None:
    model = models.build_model(name=name)
    first = model.init(jax.random.key(7))
    assert _equal_trees(first, model.init(jax.random.key(7)))
    assert not _equal_trees(first, model.init(jax.random.key(8)))


@pytest.mark.parametrize("name", catalog.MODELS)
def test_loss_and_metrics_are_finite_scalars_under_jit(name: str) -> None:
    model = models.build_model(name=name)
    params = model.init(jax.random.key(0))
    batch = _dataset_for(name).train_batch(worker=0, num_workers=2, step=0, batch_size=16)
    loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, batch)
    assert loss.shape == ()
    assert np.isfinite(loss)
    assert all(jax.tree.leaves(jax.tree.map(lambda g, p: g.shape == p.shape, grads, params)))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    metrics = jax.jit(model.evaluate)(params, _dataset_for(name).test())
    expected = {"loss"} if name == "linear" else {"loss", "accuracy"}
    assert set(metrics) == expected
    assert all(m.shape == () and np.isfinite(m) for m in metrics.values())


def _files(name: str, root: Path) -> dict[str, Any] | None:
    """Files for the datasets that read them (200 examples), else the small built-in."""
    if name == "idx":
        return {"dir": str(mnist_dir(root, train=200, test=20))}
    if name == "arrays":
        rng = np.random.default_rng(0)
        np.savez(root / "a.npz", x=rng.random((250, 3), np.float32), y=np.arange(250.0))
        return {"path": str(root / "a.npz")}
    if name == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rng = np.random.default_rng(0)
        pq.write_table(pa.table({"x": rng.random(250), "y": np.arange(250)}), root / "p.parquet")
        return {"path": str(root / "p.parquet")}
    return SMALL_SPARSE if name == "sparse" else None


@pytest.mark.parametrize("name", catalog.DATASETS)
def test_train_batches_are_deterministic_and_full(name: str, tmp_path: Path) -> None:
    kwargs = _files(name, tmp_path)
    a = datasets.build_dataset(name=name, kwargs=kwargs, seed=1)
    b = datasets.build_dataset(name=name, kwargs=kwargs, seed=1)
    other = datasets.build_dataset(name=name, kwargs=kwargs, seed=2)
    for step in (0, 1, 500):  # step 500 is several epochs in
        batch = a.train_batch(worker=1, num_workers=3, step=step, batch_size=48)
        again = b.train_batch(worker=1, num_workers=3, step=step, batch_size=48)
        assert set(batch) == set(a.test())
        assert all(len(v) == 48 and np.array_equal(v, again[k]) for k, v in batch.items())
    first, differs = a.train_batch(**_W0), other.train_batch(**_W0)
    assert any(not np.array_equal(v, differs[k]) for k, v in first.items())


def test_digits_workers_read_disjoint_shards_reshuffled_each_epoch() -> None:
    data = datasets.build_dataset(name="digits", seed=0)
    assert isinstance(data, datasets.DigitsDataset)
    shard = (data.num_train + 1) // 2  # worker 0's share; one epoch is `shard` rows

    def epoch(worker: int, number: int) -> np.ndarray:
        return data.train_indices(worker=worker, num_workers=2, step=number, batch_size=shard)

    zero, one = epoch(0, 0), epoch(1, 0)
    assert len(set(zero.tolist())) == shard  # a whole epoch visits every row of the shard once
    assert not set(zero.tolist()) & set(one.tolist())
    assert len(set(zero.tolist()) | set(one.tolist())) == data.num_train
    assert set(epoch(0, 1).tolist()) == set(zero.tolist())
    assert not np.array_equal(epoch(0, 1), zero)
    x0 = data.train_batch(worker=0, num_workers=2, step=0, batch_size=32)["x"]
    x1 = data.train_batch(worker=1, num_workers=2, step=0, batch_size=32)["x"]
    assert not np.array_equal(x0, x1)


def test_a_batch_larger_than_the_shard_spans_epochs() -> None:
    data = datasets.build_dataset(name="synthetic", kwargs={"examples": 10, "testExamples": 5})
    batch = data.train_batch(worker=0, num_workers=2, step=3, batch_size=12)
    assert batch["x"].shape == (12, 16)
    assert batch["y"].shape == (12,)
    assert len(data.test()["x"]) == 5


def test_digits_dataset_is_real_scaled_and_split_by_seed() -> None:
    data = datasets.build_dataset(name="digits", seed=0)
    assert isinstance(data, datasets.DigitsDataset)
    test = data.test()
    assert test["x"].dtype == np.float32
    assert test["y"].dtype == np.int32
    assert test["x"].min() >= 0.0
    assert test["x"].max() == 1.0
    assert data.num_train + len(test["y"]) == 1797  # load_digits() has 1797 images
    assert abs(len(test["y"]) - 0.2 * 1797) <= 5
    assert set(test["y"].tolist()) == set(range(10))
    again = datasets.build_dataset(name="digits", seed=0).test()
    other = datasets.build_dataset(name="digits", seed=1).test()
    assert np.array_equal(test["x"], again["x"])
    assert not np.array_equal(test["x"], other["x"])


def test_mlp_reaches_95_percent_on_digits_with_two_sync_workers() -> None:
    model = models.build_model(name="mlp")
    data = datasets.build_dataset(name="digits", seed=0)
    steps = [
        [data.train_batch(worker=w, num_workers=2, step=s, batch_size=32) for w in (0, 1)]
        for s in range(400)
    ]
    params, _ = _train(model, steps, tx=optax.adam(1e-2))
    accuracy = float(jax.jit(model.evaluate)(params, data.test())["accuracy"])
    assert accuracy >= 0.95


def test_embedding_loss_falls_and_ids_stay_below_id_range() -> None:
    model = models.build_model(name="embedding")
    data = datasets.build_dataset(name="sparse", seed=0)
    assert isinstance(data, datasets.SparseDataset)
    assert data.id_range == 150_000
    steps = [[data.train_batch(worker=0, num_workers=1, step=s, batch_size=64)] for s in range(300)]
    ids = np.concatenate([group[0]["ids"] for group in steps] + [data.test()["ids"]])
    assert ids.dtype == np.int64
    assert ids.min() >= 0
    assert ids.max() < data.id_range
    assert abs(float(data.test()["y"].mean()) - 0.5) < 0.05
    _, losses = _train(model, steps, tx=optax.sgd(1.0))
    assert np.mean(losses[-50:]) < np.mean(losses[:50]) - 0.08


def test_embedding_model_obeys_the_sparse_rule() -> None:
    """What the training loop does: gather the batch's unique rows, remap its ids to them."""
    model = models.build_model(name="embedding", kwargs={"rows": 1000})
    assert dict(model.sparse) == {"embedding": "ids"}
    params = model.init(jax.random.key(0))
    batch = datasets.build_dataset(
        name="sparse", kwargs={"idRange": 1000, **SMALL_SPARSE}
    ).train_batch(worker=0, num_workers=1, step=0, batch_size=64)
    unique, positions = np.unique(batch["ids"], return_inverse=True)
    pulled = {**params, "embedding": params["embedding"][unique]}
    remapped = {**batch, "ids": positions.reshape(batch["ids"].shape)}
    loss_and_grads = jax.jit(jax.value_and_grad(model.loss))
    full, full_grads = loss_and_grads(params, batch)
    rows, row_grads = loss_and_grads(pulled, remapped)
    np.testing.assert_allclose(rows, full, rtol=1e-6)
    np.testing.assert_allclose(row_grads["embedding"], full_grads["embedding"][unique], atol=1e-7)


@pytest.mark.usefixtures("user_path")
def test_user_model_example_trains_on_synthetic() -> None:
    model = models.build_model(name="mine", module="quadratic:make_model", kwargs={"features": 8})
    assert isinstance(model, models.Model)
    assert dict(model.sparse) == {}
    data = datasets.build_dataset(name="synthetic", kwargs={"features": 8}, seed=0)
    steps = [[data.train_batch(worker=0, num_workers=1, step=s, batch_size=64)] for s in range(30)]
    params, losses = _train(model, steps, tx=optax.sgd(0.05))
    assert losses[-1] < 0.5 * losses[0]
    assert float(jax.jit(model.evaluate)(params, data.test())["loss"]) < 0.5 * losses[0]


def test_model_and_dataset_that_disagree_fail_at_trace_time_naming_the_field() -> None:
    model = models.build_model(name="linear", kwargs={"features": 8})
    batch = datasets.build_dataset(name="synthetic").train_batch(**_W0)
    with pytest.raises(models.ModelError, match=r"model\.kwargs\.features: .*8 columns"):
        jax.jit(model.loss)(model.init(jax.random.key(0)), batch)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"name": "cnn"}, "model.name: 'cnn' is not a built-in model; allowed: linear, mlp, embed"),
        ({"name": "mlp", "kwargs": {"hiden": [8]}}, "model.kwargs.hiden: unknown argument"),
        ({"name": "mlp", "kwargs": {"hidden": 64}}, "model.kwargs.hidden: expected a list"),
        ({"name": "mlp", "kwargs": {"hidden": [64, 0]}}, "model.kwargs.hidden[1]: expected an in"),
        ({"name": "mlp", "kwargs": {"hidden": ["64"]}}, "model.kwargs.hidden[0]: expected an in"),
        ({"name": "mlp", "kwargs": {"classes": 1}}, "model.kwargs.classes: expected an integer >="),
        ({"name": "embedding", "kwargs": {"rows": 0}}, "model.kwargs.rows: expected an integer"),
        ({"name": "linear", "kwargs": {"features": True}}, "model.kwargs.features: expected an"),
        ({"name": "linear", "kwargs": [1]}, "model.kwargs: expected an object"),
    ],
)
def test_bad_model_configs_name_the_field(config: Mapping[str, Any], message: str) -> None:
    with pytest.raises(models.ModelError) as caught:
        models.build_model(**config)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"name": "mnist"}, "dataset.name: 'mnist' is not a built-in dataset; allowed: synthetic"),
        ({"name": "digits", "kwargs": {"testSize": 0.1}}, "dataset.kwargs.testSize: unknown"),
        ({"name": "digits", "kwargs": {"testFraction": 1.5}}, "dataset.kwargs.testFraction: exp"),
        ({"name": "sparse", "kwargs": {"idRange": -1}}, "dataset.kwargs.idRange: expected an int"),
        ({"name": "synthetic", "kwargs": {"examples": 1.5}}, "dataset.kwargs.examples: expected"),
        ({"name": "synthetic", "seed": -1}, "seed: expected an integer >= 0, got -1"),
    ],
)
def test_bad_dataset_configs_name_the_field(config: Mapping[str, Any], message: str) -> None:
    with pytest.raises(models.ModelError) as caught:
        datasets.build_dataset(**config)
    assert message in str(caught.value)
    if "unknown" in message:
        assert "allowed: testFraction" in str(caught.value)


_USER_MODULE = """
class NotAModel:
    sparse = {}
    def init(self, key):
        return {}

def not_a_model():
    return NotAModel()

def strict(*, width):
    raise AssertionError("unreachable in these tests")

VALUE = 3
"""


@pytest.mark.parametrize(
    ("module", "kwargs", "message"),
    [
        ("mymodels", None, "model.module: 'mymodels' is malformed; expected 'package.module:fac"),
        ("a:b:c", None, "model.module: 'a:b:c' is malformed"),
        ("no_such_pkg.x:make", None, "model.module: 'no_such_pkg.x:make': cannot import 'no_such"),
        ("usermod:missing", None, "model.module: 'usermod:missing': 'usermod' has no attribute"),
        ("usermod:VALUE", None, "model.module: 'usermod:VALUE': 'VALUE' is not callable"),
        ("usermod:not_a_model", None, "lacking loss, evaluate; a model needs sparse, init"),
        ("usermod:strict", {"depth": 2}, "model.kwargs: usermod:strict refused them: "),
        ("usermod:strict", [2], "model.kwargs: expected an object"),
    ],
)
def test_bad_user_modules_name_the_field(
    module: str, kwargs: Any, message: str, user_path: Path
) -> None:
    (user_path / "usermod.py").write_text(textwrap.dedent(_USER_MODULE))
    with pytest.raises(models.ModelError) as caught:
        models.build_model(name="mine", module=module, kwargs=kwargs)
    assert message in str(caught.value)


@pytest.mark.usefixtures("user_path")
def test_example_factory_errors_are_reported_as_model_kwargs() -> None:
    with pytest.raises(models.ModelError, match=r"model\.kwargs: .*features: expected an integer"):
        models.build_model(name="q", module="quadratic:make_model", kwargs={"features": 0})


def test_builtin_models_are_models_and_defaults_cover_them() -> None:
    assert set(catalog.DEFAULT_DATASET) == set(catalog.MODELS)
    assert set(catalog.DEFAULT_DATASET.values()) <= set(catalog.DATASETS)
    for name in catalog.MODELS:
        assert isinstance(models.build_model(name=name), models.Model)


@pytest.mark.parametrize(
    ("labels", "words"),
    [
        (np.array([0, 3, 9]), None),
        (np.array([0, -1, 3]), "a label -1, but model mlp has 10 classes (labels 0..9)"),
        (np.array([10, 3]), "a label 10, but model mlp has 10 classes (labels 0..9)"),
        (np.array([0.0, 1.0]), "labels of dtype float64; model mlp takes integer class labels"),
        (np.array([], np.int32), None),
    ],
)
def test_a_classifiers_labels_are_checked_against_its_classes(
    labels: np.ndarray, words: str | None
) -> None:
    problem = models.label_problem(
        models.MlpModel(classes=10), {"x": np.zeros((3, 64)), "y": labels}
    )
    assert problem == words if words is None else words in (problem or ""), problem


def test_other_models_labels_are_theirs_to_judge() -> None:
    embedding = models.EmbeddingModel(rows=10, dim=2)
    assert models.label_problem(embedding, {"ids": np.zeros((2, 1)), "y": np.array([7])}) is None
