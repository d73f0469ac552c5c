"""`program.own_optimizers`: parts of a program's variable tree given optimizers of their own,
resolved to variable names, the deeper part winning; a part naming no variable or an optimizer
optax does not have is refused, naming it."""

from __future__ import annotations

import pytest

from jaxps_runtime.config.training import OptimizerConfig
from jaxps_runtime.train.program import own_optimizers

NAMES = [
    "['discriminator']['l0']['kernel']",
    "['generator']['l0']['bias']",
    "['generator']['l0']['kernel']",
    "['generator']['l1']['kernel']",
    "['generatorx']",
]
ADAM = {"name": "adam", "kwargs": {"learning_rate": 0.001}}
SGD = {"name": "sgd", "kwargs": {"learning_rate": 0.1}}


def test_a_part_of_the_tree_gives_every_variable_under_it_its_optimizer() -> None:
    found = own_optimizers(NAMES, {"generator": ADAM})
    assert sorted(found) == [n for n in NAMES if n.startswith("['generator'][")]
    assert all(v == OptimizerConfig.from_dict(ADAM) for v in found.values())


def test_the_deeper_part_wins() -> None:
    found = own_optimizers(NAMES, {"generator": ADAM, "generator/l0": SGD})
    assert found["['generator']['l0']['kernel']"].name == "sgd"
    assert found["['generator']['l0']['bias']"].name == "sgd"
    assert found["['generator']['l1']['kernel']"].name == "adam"
    assert "['discriminator']['l0']['kernel']" not in found


def test_a_part_naming_no_variable_is_refused_with_the_variables() -> None:
    with pytest.raises(ValueError, match=r"\['gen'\]: names no variable; the variables: "):
        own_optimizers(NAMES, {"gen": ADAM})


def test_an_optimizer_optax_refuses_is_refused_naming_the_part() -> None:
    with pytest.raises(Exception, match=r"optimizers\)\['generator'\].*learning_rate"):
        own_optimizers(NAMES, {"generator": {"name": "adam", "kwargs": {"learning_rate": "x"}}})
