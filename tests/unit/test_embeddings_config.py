"""`training.embeddings` (issue 58) as the operator and every task read it: each bad table
field named with its value and what is allowed, every problem of every table listed."""

from __future__ import annotations

from typing import Any

import pytest

from jaxps_runtime.config import training


def embeddings(**table: Any) -> dict[str, Any]:
    return {"batchSize": 32, "embeddings": {"items": {"dim": 8, "maxRows": 1000, **table}}}


def test_a_table_with_its_defaults() -> None:
    config = training.parse(embeddings())
    items = config.embeddings["items"]
    assert (items.dim, items.maxRows, items.eviction) == (8, 1000, "lru")
    assert (items.admission.minCount, items.admission.probability) == (1, 1.0)
    assert items.initializer.scale == 0.05
    # what the operator hands the tasks reads back the same
    assert training.parse(config.to_dict()).embeddings == config.embeddings


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({"dim": 0}, "training.embeddings.items.dim: got 0; expected an integer >= 1"),
        ({"maxRows": 16}, "training.embeddings.items.maxRows: got 16; expected at least batchSize"),
        (
            {"eviction": "fifo"},
            'training.embeddings.items.eviction: got "fifo"; expected one of lru, lfu',
        ),
        ({"admission": {"minCount": 0}}, "training.embeddings.items.admission.minCount: got 0"),
        ({"admission": {"probability": 1.5}}, "admission.probability: got 1.5; expected in (0, 1]"),
        ({"admission": {"probability": 0}}, "admission.probability: got 0.0; expected in (0, 1]"),
        ({"initializer": {"scale": -1}}, "initializer.scale: got -1; expected a number >= 0"),
        ({"size": 3}, "training.embeddings.items.size: unknown field; allowed: admission, dim"),
    ],
)
def test_a_bad_field_is_named_with_its_value_and_what_is_allowed(
    table: dict[str, Any], problem: str
) -> None:
    found = training.problems(embeddings(**table))
    assert any(problem in line for line in found), found


def test_every_problem_of_every_table_is_listed() -> None:
    found = training.problems(
        {"embeddings": {"a": {"dim": 0, "maxRows": 100, "eviction": "x"}, "b": {"dim": 4}, "c": 7}}
    )
    assert found == [
        "training.embeddings.a.dim: got 0; expected an integer >= 1",
        'training.embeddings.a.eviction: got "x"; expected one of lru, lfu',
        "training.embeddings.b.maxRows: missing; expected an integer >= 1",
        "training.embeddings.c: got 7; expected an object",
    ]


def test_embeddings_must_be_an_object_of_tables() -> None:
    assert training.problems({"embeddings": [1]}) == [
        "training.embeddings: got [1]; expected an object of tables: {<table>: {dim, maxRows, ...}}"
    ]
