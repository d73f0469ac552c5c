"""Optimizers by name: clear errors at the edge, exact updates, sparse rows only."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxps_runtime.config import catalog
from jaxps_runtime.config import training as config
from jaxps_runtime.ps import optim


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(
            {"name": "sgdd"},
            'Init.optimizer.name: got "sgdd"; expected one of adabelief, ',
            id="unknown-name",
        ),
        pytest.param({"name": "_scale"}, 'got "_scale"; expected one of', id="private-name"),
        pytest.param(
            {"name": "sgd", "kwargs": {"lr": 0.1}},
            "Init.optimizer.kwargs.lr: optax.sgd has no argument 'lr'",
            id="unknown-kwarg",
        ),
        pytest.param(
            {"name": "sgd"},
            "Init.optimizer.kwargs.learning_rate: missing; optax.sgd requires learning_rate",
            id="missing-kwarg",
        ),
    ],
)
def test_a_ps_reads_the_optimizer_of_an_init_with_the_configurations_rules(
    raw: dict[str, object], message: str
) -> None:
    """The ps's edge (the optimizer comes as JSON over gRPC) and a job's configuration share
    one check, `OptimizerConfig.from_json`/`from_dict`; `build` takes what it returns."""
    with pytest.raises(optim.OptimizerError) as caught:
        config.OptimizerConfig.from_json(json.dumps(raw), where="Init.optimizer")
    assert message in str(caught.value)


def test_what_optax_refuses_when_called_is_refused_at_build_naming_the_field() -> None:
    optimizer = config.OptimizerConfig("adam", {"learning_rate": 0.1, "mu_dtype": "nonsense"})
    with pytest.raises(optim.OptimizerError) as caught:
        optim.build(optimizer)
    assert "optimizer.kwargs: optax.adam refused them: data type 'nonsense' not understood" in (
        str(caught.value)
    )


def test_an_optimizer_the_installed_optax_lacks_is_refused_naming_the_field() -> None:
    with pytest.raises(optim.OptimizerError, match=r"optimizer\.name: optax\.sgdd is not in the"):
        optim.build(config.OptimizerConfig("sgdd", {"learning_rate": 0.1}))


def test_every_optimizer_of_the_table_builds_with_a_learning_rate() -> None:
    for name in catalog.optimizers():
        assert isinstance(
            optim.build(config.OptimizerConfig(name, {"learning_rate": 0.1})),
            optax.GradientTransformation,
        )


def test_dense_update_equals_optax_on_the_whole_leaf() -> None:
    tx = optax.adam(1e-2)
    applier = optim.Applier(tx)
    param = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    grad = jnp.ones((3, 4), jnp.float32)
    state = applier.init(param)
    new, _ = applier.dense(param, state, grad)
    updates, _ = tx.update(grad, tx.init(param), param)
    assert np.array_equal(np.asarray(new), np.asarray(optax.apply_updates(param, updates)))


def test_sparse_update_touches_only_the_given_rows_in_place() -> None:
    applier = optim.Applier(optax.adagrad(1.0, initial_accumulator_value=0.0, eps=0.0))
    table = jnp.zeros((100, 3), jnp.float32)
    param, state = optim.host_copy(table, applier.init(table))
    accum = state[0].sum_of_squares
    state = applier.sparse(param, state, np.array([5, 9, 40]), np.ones((3, 3), np.float32))
    assert state[0].sum_of_squares is accum  # written in place, not replaced
    assert np.allclose(param[[5, 9, 40]], -1.0)
    assert not np.delete(param, [5, 9, 40], axis=0).any()
    assert np.allclose(accum[[5, 9, 40]], 1.0)
    assert not np.delete(accum, [5, 9, 40], axis=0).any()


def test_a_sparse_update_equals_the_dense_update_of_those_rows() -> None:
    tx = optax.adam(1e-2)
    applier = optim.Applier(tx)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 4)).astype(np.float32)
    ids, grads = np.array([3, 17, 42]), rng.standard_normal((3, 4)).astype(np.float32)
    param, state = optim.host_copy(table, applier.init(jnp.asarray(table)))
    state = applier.sparse(param, state, ids, grads)
    rows = jnp.asarray(table[ids])
    updates, _ = tx.update(jnp.asarray(grads), tx.init(rows), rows)
    assert np.allclose(param[ids], np.asarray(optax.apply_updates(rows, updates)), atol=1e-6)
    assert np.array_equal(np.delete(param, ids, axis=0), np.delete(table, ids, axis=0))
    assert int(state[0].count) == 1


def test_duplicate_rows_are_summed() -> None:
    ids, grads = optim.sum_duplicate_rows(
        np.array([4, 1, 4, 4]), np.array([[1.0], [2.0], [3.0], [4.0]])
    )
    assert ids.tolist() == [1, 4]
    assert grads.tolist() == [[2.0], [8.0]]
