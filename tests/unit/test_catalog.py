"""The catalog of built-ins: complete, checked keyword arguments and an optimizer table that
matches the installed optax."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jaxps_runtime import catalog


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
    table["adam"] = catalog.Optimizer(parameters=("learning_rate",), required=())
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
    table.write_text(catalog.OPTIMIZER_TABLE.read_text().replace('"eps", ', "", 1))
    assert catalog.main(["--check", "--table", str(table)]) == 1
    err = capsys.readouterr().err
    assert f"{table} drifted from the installed optax:" in err
    assert "  optax.adabelief: the table has parameters" in err
    assert "run `python -m jaxps_runtime.catalog --write`" in err
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
