"""Flax modules as jaxps models (Linen and NNX), from the factories of examples/flax_cnn, and the
errors a wrong factory gets."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxps_runtime.data import builtin as datasets
from jaxps_runtime.model import builtin as models
from jaxps_runtime.model import flaxmodel, scores

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flax_cnn"


@pytest.fixture(autouse=True)
def _on_path() -> Iterator[None]:
    sys.path.insert(0, str(EXAMPLE))
    yield
    sys.path.remove(str(EXAMPLE))


def _batch(n: int = 16, side: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.random((n, side * side), dtype=np.float32),
        "y": rng.integers(0, 10, n).astype(np.int32),
    }


def _build(module: str, kwargs: dict[str, Any] | None = None) -> models.Model:
    batch = _batch()
    return models.build_model(
        name="cnn",
        module=module,
        kwargs=kwargs,
        example=lambda: {k: v[:1] for k, v in batch.items()},
    )


@pytest.mark.parametrize("factory", ["cnn:make", "cnn:make_nnx"])
def test_a_flax_module_and_its_loss_train_as_a_jaxps_model(factory: str) -> None:
    model = _build(factory, {"features": 4})
    assert isinstance(model, models.Model)
    assert dict(model.sparse) == {}
    params = model.init(jax.random.PRNGKey(0))
    leaves = jax.tree_util.tree_leaves(params)
    assert leaves
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, batch)
    assert np.isfinite(float(loss))
    assert str(jax.tree_util.tree_structure(grads)) == str(jax.tree_util.tree_structure(params))
    # a few steps of plain gradient descent lower the loss on the batch they see
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda a, g: a - 0.5 * g, p, grads))
    after = float(model.loss(step(params), batch))
    assert after < float(loss)
    metrics = jax.jit(model.evaluate)(params, batch)
    assert set(metrics) == {"loss", "accuracy"}
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0


def test_linen_parameters_follow_the_seed() -> None:
    model = _build("cnn:make")
    first = model.init(jax.random.PRNGKey(1))
    again = model.init(jax.random.PRNGKey(1))
    other = model.init(jax.random.PRNGKey(2))
    same = jax.tree_util.tree_map(np.array_equal, first, again)
    assert all(jax.tree_util.tree_leaves(same))
    assert not all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.array_equal, first, other)))


def test_a_loss_function_and_extra_metrics() -> None:
    cnn = sys.modules.get("cnn") or __import__("cnn")
    module, _ = cnn.make(features=4)

    def loss(outputs: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean(outputs**2)

    made = flaxmodel.adapt(
        {"module": module, "loss": loss, "metrics": cnn.accuracy_percent},
        where="model.module",
        example=lambda: {k: v[:1] for k, v in _batch().items()},
    )
    params = made.init(jax.random.PRNGKey(0))
    metrics = made.evaluate(params, {k: jnp.asarray(v) for k, v in _batch().items()})
    assert set(metrics) == {"loss", "accuracy_percent"}


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda m: (m, "hinge"), "loss 'hinge' is neither a function"),
        (lambda m: (m, "softmax_cross_entropy", 3), "a tuple of 3; expected (module, loss)"),
        (lambda m: {"module": m, "input": "x"}, "unknown key 'input'"),
        (lambda m: {"module": m, "inputs": []}, "inputs []: expected a batch key"),
        (lambda m: {"module": m, "labels": 3}, "labels 3: expected a batch key"),
    ],
)
def test_a_wrong_flax_factory_is_named(returned: Any, message: str) -> None:
    cnn = __import__("cnn")
    with pytest.raises(models.ModelError, match=r"model\.module") as caught:
        flaxmodel.adapt(
            returned(cnn.CNN()),
            where="model.module: 'cnn:make'",
            example=lambda: {k: v[:1] for k, v in _batch().items()},
        )
    assert message in str(caught.value)


def test_a_batch_without_the_modules_input_is_named() -> None:
    cnn = __import__("cnn")
    with pytest.raises(models.ModelError, match="the batch has no key 'pixels'"):
        flaxmodel.adapt(
            {"module": cnn.CNN(), "inputs": "pixels"},
            where="model.module",
            example=lambda: {k: v[:1] for k, v in _batch().items()},
        )


def test_auc_against_counting_pairs() -> None:
    rng = np.random.default_rng(3)
    values = np.round(rng.standard_normal(200), 1).astype(np.float32)  # with ties
    labels = (values + rng.standard_normal(200) > 0).astype(np.float32)
    pos, neg = values[labels == 1], values[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    expected = pairs / (len(pos) * len(neg))
    assert float(scores.auc(jnp.asarray(values), jnp.asarray(labels))) == pytest.approx(
        expected, abs=1e-5
    )
    assert np.isnan(float(scores.auc(jnp.ones(4), jnp.ones(4))))


def test_mlp_takes_its_inputs_from_the_dataset_unless_set() -> None:
    wide = {"x": np.zeros((1, 784), np.float32), "y": np.zeros(1, np.int32)}
    auto = models.build_model(name="mlp", example=lambda: wide)
    assert auto.init(jax.random.PRNGKey(0))["hidden_0"]["kernel"].shape == (784, 64)
    assert (
        models.build_model(name="mlp").init(jax.random.PRNGKey(0))["hidden_0"]["kernel"].shape[0]
        == 64
    )
    fixed = models.build_model(name="mlp", kwargs={"inputs": 13}, example=lambda: wide)
    assert fixed.init(jax.random.PRNGKey(0))["hidden_0"]["kernel"].shape == (13, 64)


def test_idx_falls_back_to_a_built_in_only_when_no_file_is_there(tmp_path: Path) -> None:
    data = datasets.build_dataset(name="idx", kwargs={"dir": str(tmp_path), "fallback": "digits"})
    assert data.train_batch(worker=0, num_workers=1, step=0, batch_size=4)["x"].shape == (4, 64)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")  # one file: no fallback
    with pytest.raises(models.ModelError, match=r"dataset\.kwargs\.dir"):
        datasets.build_dataset(name="idx", kwargs={"dir": str(tmp_path), "fallback": "digits"})
    with pytest.raises(models.ModelError, match=r"dataset\.kwargs\.fallback: 'idx' is not"):
        datasets.build_dataset(name="idx", kwargs={"dir": str(tmp_path), "fallback": "idx"})
