"""The catalog of built-ins: complete, checked keyword arguments and an optimizer table that
matches the installed optax."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optax
import pytest

from jaxps_runtime.config import catalog


def test_a_built_in_model_gets_every_default_and_keeps_what_is_given() -> None:
    assert catalog.check_model("mlp", {"hidden": [32, 16]}) == {
        "hidden": (32, 16),
        "inputs": None,  # the dataset's width
        "classes": 10,
    }
    assert catalog.check_model("linear", None) == {"features": 16}


def test_a_built_in_dataset_gets_every_default() -> None:
    assert catalog.check_dataset("digits", {}) == {"testFraction": 0.2}
    assert catalog.check_dataset("sparse", {"idRange": 10})["idRange"] == 10


@pytest.mark.parametrize(
    ("check", "name", "kwargs", "message"),
    [
        pytest.param(
            catalog.check_model,
            "resnet",
            None,
            "training.model.name: 'resnet' is not a built-in model; allowed: linear, mlp, "
            "embedding (or set training.model.module",
            id="model-name",
        ),
        pytest.param(
            catalog.check_model,
            "mlp",
            {"classes": 1},
            "training.model.kwargs.classes: expected an integer >= 2, got 1",
            id="model-bound",
        ),
        pytest.param(
            catalog.check_model,
            "mlp",
            {"hidden": 64},
            "training.model.kwargs.hidden: expected a list of layer widths",
            id="model-type",
        ),
        pytest.param(
            catalog.check_model,
            "embedding",
            {"row": 5},
            "training.model.kwargs.row: unknown argument 'row'; allowed: rows, dim, idsPerExample",
            id="model-unknown-kwarg",
        ),
        pytest.param(
            catalog.check_dataset,
            "mnist",
            None,
            "training.dataset.name: 'mnist' is not a built-in dataset; allowed: synthetic",
            id="dataset-name",
        ),
        pytest.param(
            catalog.check_dataset,
            "synthetic",
            {"examples": 1.5},
            "training.dataset.kwargs.examples: expected an integer >= 1, got 1.5",
            id="dataset-type",
        ),
        pytest.param(
            catalog.check_dataset,
            "digits",
            [0.1],
            "training.dataset.kwargs: expected an object of keyword arguments, got [0.1]",
            id="dataset-kwargs-not-object",
        ),
    ],
)
def test_bad_built_in_kwargs_name_the_field_the_value_and_what_is_allowed(
    check: Any, name: str, kwargs: Any, message: str
) -> None:
    where = "training.model" if check is catalog.check_model else "training.dataset"
    with pytest.raises(catalog.ModelError) as caught:
        check(name, kwargs, where=where)
    assert message in str(caught.value)


def test_a_user_model_module_is_split_without_being_imported() -> None:
    assert catalog.check_module("pkg.models:make.model") == ("pkg.models", "make.model")
    for malformed in ("pkg.models", "a:b:c", "pkg.:make", 3):
        with pytest.raises(catalog.ModelError, match=r"model\.module: .* is malformed"):
            catalog.check_module(malformed)


def test_every_default_model_dataset_is_a_built_in() -> None:
    assert set(catalog.DEFAULT_DATASET) == set(catalog.MODELS)
    assert set(catalog.DEFAULT_DATASET.values()) <= set(catalog.DATASETS)


def test_an_unknown_optimizer_is_refused_listing_the_table_sorted() -> None:
    with pytest.raises(catalog.OptimizerError) as caught:
        catalog.check_optimizer("sgdd", {}, where="training.optimizer")
    names = list(catalog.optimizers())
    assert names == sorted(names)
    assert {"sgd", "adam", "adagrad", "rmsprop"} <= set(names)
    assert str(caught.value) == (
        f'training.optimizer.name: got "sgdd"; expected one of {", ".join(names)}'
    )


def test_optimizer_arguments_are_checked_by_name_and_required_ones_must_be_there() -> None:
    assert catalog.check_optimizer("adam", {"learning_rate": 0.1, "b1": 0.8}) == "adam"
    assert catalog.check_optimizer("adadelta", {}) == "adadelta"  # its learning_rate is optional
    with pytest.raises(catalog.OptimizerError, match=r"optimizer\.kwargs\.lr: optax\.adam has no"):
        catalog.check_optimizer("adam", {"lr": 0.1})
    with pytest.raises(
        catalog.OptimizerError,
        match=r"optimizer\.kwargs\.learning_rate: missing; optax\.sgd requires learning_rate",
    ):
        catalog.check_optimizer("sgd", {"momentum": 0.9})


def test_the_optimizer_table_matches_the_installed_optax() -> None:
    assert catalog.drift(catalog.optimizers(), catalog.installed_optimizers()) == []
    assert catalog.main(["--check"]) == 0


def test_a_table_that_drifted_from_optax_names_what_drifted() -> None:
    table = dict(catalog.optimizers())
    del table["sgd"]
    table["adamm"] = table["adam"]
    table["adam"] = catalog.Optimizer(
        parameters={"learning_rate": table["adamm"].parameters["learning_rate"]}, required=()
    )
    assert catalog.drift(table, catalog.installed_optimizers()) == [
        "optax.adam: the table has parameters ['learning_rate'] (required []), optax has "
        f"{list(table['adamm'].parameters)} (required ['learning_rate'])",
        "optax.adamm: in the table, not in the installed optax",
        "optax.sgd: in the installed optax, not in the table",
    ]


def test_check_exits_1_on_an_altered_table_and_write_repairs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "optimizers.json"
    table.write_text(catalog.OPTIMIZER_TABLE.read_text().replace('"exclusiveMinimum": 0, ', "", 1))
    assert catalog.main(["--check", "--table", str(table)]) == 1
    err = capsys.readouterr().err
    assert f"{table} drifted from the installed optax:" in err
    assert (
        '  optax.adabelief(learning_rate): the table has {"type": "number", "schedule": true}, '
        'optax and catalog.BOUNDS give {"type": "number", "exclusiveMinimum": 0, '
        '"schedule": true}'
    ) in err
    assert "run `python -m jaxps_runtime.config --write`" in err
    assert catalog.main(["--write", "--table", str(table)]) == 0
    assert table.read_text() == catalog.OPTIMIZER_TABLE.read_text()
    assert catalog.main(["--check", "--table", str(table)]) == 0


def test_check_exits_1_on_a_table_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "optimizers.json"
    table.write_text("{")
    assert catalog.main(["--check", "--table", str(table)]) == 1
    assert "cannot read it (JSONDecodeError" in capsys.readouterr().err


# --- what a manifest may give an optimizer's arguments ------------------------------------------

SCHEDULE = "(optax.adam also takes a schedule, a callable of the step, which JSON cannot express)"
BAD_ARGUMENTS = [
    pytest.param(
        "adam",
        {"learning_rate": "0.01"},
        f'kwargs.learning_rate: got "0.01"; expected a finite number > 0 {SCHEDULE}',
        id="learning-rate-a-string",
    ),
    pytest.param(
        "adam",
        {"learning_rate": 0},
        f"kwargs.learning_rate: got 0; expected a finite number > 0 {SCHEDULE}",
        id="learning-rate-zero",
    ),
    pytest.param(
        "adam",
        {"learning_rate": float("inf")},
        "kwargs.learning_rate: got Infinity; expected a finite number > 0",
        id="learning-rate-infinite",
    ),
    pytest.param(
        "adam",
        {"learning_rate": 0.1, "b1": 1.0},
        "kwargs.b1: got 1.0; expected a finite number >= 0 and < 1",
        id="b1-of-one",
    ),
    pytest.param(
        "adam",
        {"learning_rate": 0.1, "b2": True},
        "kwargs.b2: got true; expected a finite number >= 0 and < 1",
        id="b2-a-boolean",
    ),
    pytest.param(
        "adam",
        {"learning_rate": 0.1, "eps": -1e-8},
        "kwargs.eps: got -1e-08; expected a finite number >= 0",
        id="eps-negative",
    ),
    pytest.param(
        "sgd",
        {"learning_rate": 0.1, "momentum": 1.5},
        "kwargs.momentum: got 1.5; expected null or a finite number >= 0 and <= 1",
        id="momentum-above-one",
    ),
    pytest.param(
        "lbfgs",
        {"memory_size": 2.5},
        "kwargs.memory_size: got 2.5; expected an integer >= 1",
        id="memory-size-a-fraction",
    ),
    pytest.param(
        "adam",
        {"learning_rate": 0.1, "nesterov": "yes"},
        'kwargs.nesterov: got "yes"; expected true or false',
        id="nesterov-a-string",
    ),
    pytest.param(
        "adam",
        {"learning_rate": 0.1, "mu_dtype": "bfloat16"},
        'kwargs.mu_dtype: got "bfloat16"; expected null (its default) or no value: optax.adam '
        "takes a dtype here, which a manifest cannot give",
        id="dtype",
    ),
    pytest.param(
        "adamw",
        {"learning_rate": 0.1, "mask": {"kernel": True}},
        'kwargs.mask: got {"kernel": true}; expected null (its default) or no value: '
        "optax.adamw takes a mask (a pytree of booleans, or a callable that makes one) here",
        id="mask",
    ),
    pytest.param(
        "lbfgs",
        {"linesearch": None},
        "kwargs.linesearch: got null; expected no value (leave it out): optax.lbfgs takes an "
        "optax transformation here",
        id="transformation-with-a-default-json-cannot-give",
    ),
    pytest.param(
        "noisy_sgd",
        {"learning_rate": 0.1, "key": 0},
        "kwargs.key: got 0; expected null (its default) or no value: optax.noisy_sgd takes a "
        "JAX PRNG key (give seed instead) here",
        id="prng-key",
    ),
    pytest.param(
        "noisy_sgd",
        {"learning_rate": 0.1, "seed": -1},
        "kwargs.seed: got -1; expected null or an integer >= 0",
        id="seed-negative",
    ),
]


@pytest.mark.parametrize(("name", "kwargs", "message"), BAD_ARGUMENTS)
def test_an_argument_of_the_wrong_type_or_range_is_refused_naming_it_and_what_is_allowed(
    name: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(catalog.OptimizerError) as caught:
        catalog.check_optimizer(name, kwargs, where="spec.training.optimizer")
    assert str(caught.value).startswith(f"spec.training.optimizer.{message}")


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        pytest.param("adam", {"learning_rate": 1}, id="an-integer-learning-rate"),
        pytest.param("adam", {"learning_rate": 0.1, "nesterov": True}, id="a-boolean"),
        pytest.param("adam", {"learning_rate": 0.1, "mu_dtype": None}, id="a-dtype-left-null"),
        pytest.param("sgd", {"learning_rate": 0.1, "momentum": None}, id="an-optional-number"),
        pytest.param("adadelta", {"learning_rate": None}, id="an-optional-learning-rate"),
        pytest.param("lars", {"learning_rate": 0.1, "trust_ratio_mask": True}, id="mask-default"),
        pytest.param("lbfgs", {"memory_size": 5}, id="an-integer"),
        pytest.param("noisy_sgd", {"learning_rate": 0.1, "seed": 3}, id="a-seed"),
    ],
)
def test_values_json_can_give_as_optax_takes_them_are_accepted(
    name: str, kwargs: dict[str, Any]
) -> None:
    assert catalog.check_optimizer(name, kwargs) == name


def test_every_bad_argument_is_listed_not_just_the_first() -> None:
    with pytest.raises(catalog.OptimizerError) as caught:
        catalog.check_optimizer("adam", {"learning_rate": "fast", "b1": 2, "lr": 1, "b2": 0.9})
    assert [problem.split(":")[0] for problem in caught.value.problems] == [
        "optimizer.kwargs.learning_rate",
        "optimizer.kwargs.b1",
        "optimizer.kwargs.lr",
    ]


def test_every_default_of_every_optimizer_that_json_can_give_is_accepted() -> None:
    """The types read from optax's annotations take optax's own defaults."""
    for name, optimizer in catalog.optimizers().items():
        for key, p in inspect.signature(getattr(optax, name)).parameters.items():
            if p.default is None or isinstance(p.default, bool | int | float):
                kwargs = {**dict.fromkeys(optimizer.required, 0.1), key: p.default}
                assert catalog.check_optimizer(name, kwargs) == name, (name, key)


def _signature_of(function: Callable[..., object]) -> dict[str, catalog.Parameter]:
    return {
        key: catalog.parameter("toy", p)
        for key, p in inspect.signature(function, eval_str=True).parameters.items()
    }


def test_what_a_manifest_may_give_is_read_from_annotations_defaults_and_the_bounds() -> None:
    def toy(
        learning_rate: float | Callable[[int], float],
        *,
        b1: float = 0.9,
        memory_size: int = 10,
        nesterov: bool = False,
        momentum: float | None = None,
        mask: Any | Callable[[Any], Any] | None = None,
        mu_dtype: Any = "float32",
    ) -> None:
        del learning_rate, b1, memory_size, nesterov, momentum, mask, mu_dtype

    assert _signature_of(toy) == {
        "learning_rate": catalog.Parameter(
            catalog.NUMBER, bounds=catalog.Bounds(above=0), schedule=True
        ),
        "b1": catalog.Parameter(catalog.NUMBER, bounds=catalog.Bounds(minimum=0, below=1)),
        "memory_size": catalog.Parameter(catalog.INTEGER, bounds=catalog.Bounds(minimum=1)),
        "nesterov": catalog.Parameter(catalog.BOOLEAN),
        "momentum": catalog.Parameter(
            catalog.NUMBER, nullable=True, bounds=catalog.Bounds(minimum=0, maximum=1)
        ),
        "mask": catalog.Parameter(
            catalog.FIXED,
            takes="a mask (a pytree of booleans, or a callable that makes one)",
            allowed=(None,),
        ),
        "mu_dtype": catalog.Parameter(catalog.FIXED, takes="a dtype", allowed=()),
    }


def test_a_bound_that_refuses_optax_s_own_default_fails_the_write() -> None:
    def toy(learning_rate: float, b1: float = 1.5) -> None:
        del learning_rate, b1

    with pytest.raises(catalog.OptimizerError, match=r"optax\.toy: its default b1=1\.5 is outside"):
        _signature_of(toy)
