"""Placement: deterministic, balanced, and a partition that round-trips."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from jaxps_runtime.client import placement
from jaxps_runtime.client.placement import Variable
from jaxps_runtime.config import catalog


def _many_leaves(seed: int = 0) -> list[Variable]:
    rng = random.Random(seed)
    out = []
    for i in range(60):
        rows = rng.choice([1, 3, 64, 300, 1000, 4096])
        cols = rng.choice([1, 8, 32, 128, 256])
        out.append(Variable(f"layer_{i:02d}/kernel", (rows, cols), "float32"))
        out.append(Variable(f"layer_{i:02d}/bias", (cols,), "float32"))
    out.append(Variable("global/scale", (), "float32"))
    return out


@pytest.mark.parametrize("strategy", catalog.STRATEGIES)
@pytest.mark.parametrize("num_ps", [1, 2, 3, 5])
def test_placement_does_not_depend_on_the_order_leaves_come_in(strategy: str, num_ps: int) -> None:
    leaves = _many_leaves()
    first = placement.plan(leaves, num_ps=num_ps, strategy=strategy)
    for seed in range(5):
        shuffled = leaves[:]
        random.Random(seed).shuffle(shuffled)
        again = placement.plan(shuffled, num_ps=num_ps, strategy=strategy)
        assert again == first
        assert json.dumps(again.to_dict()) == json.dumps(first.to_dict())


@pytest.mark.parametrize("num_ps", [2, 3, 4])
def test_greedy_placement_balances_bytes_over_ps_tasks(num_ps: int) -> None:
    result = placement.plan(_many_leaves(), num_ps=num_ps)
    load = result.bytes_per_ps()
    assert sum(load) == sum(v.nbytes for v in _many_leaves())
    assert max(load) / min(load) < 1.05, load


def test_round_robin_places_shards_in_name_order() -> None:
    leaves = [Variable(n, (4,), "float32") for n in "dcba"]
    result = placement.plan(leaves, num_ps=3, strategy=catalog.ROUND_ROBIN)
    assert [(s.variable.name, s.ps) for s in result.shards] == [
        ("a", 0),
        ("b", 1),
        ("c", 2),
        ("d", 0),
    ]


def test_only_leaves_above_min_shard_bytes_are_split_at_most_once_per_ps() -> None:
    small = Variable("small", (64, 1024), "float32")  # 256 KiB: not above the threshold
    big = Variable("big", (1000, 1024), "float32")  # ~3.9 MiB: split over every ps
    medium = Variable("medium", (100, 1024), "float32")  # ~400 KiB: 1 part of >= 256 KiB
    result = placement.plan([small, big, medium], num_ps=4)
    assert len(result.shards_of("small")) == 1
    assert len(result.shards_of("medium")) == 1
    parts = result.shards_of("big")
    assert len(parts) == 4
    assert len({p.ps for p in parts}) == 4  # never two parts on one ps
    assert [(p.start, p.stop) for p in parts] == [(0, 250), (250, 500), (500, 750), (750, 1000)]


def test_min_shard_bytes_bounds_the_number_of_parts() -> None:
    leaf = Variable("e", (10, 100_000), "float32")  # 4 MB, 10 rows
    assert len(placement.plan([leaf], num_ps=16).shards) == 10  # no more parts than rows
    assert len(placement.plan([leaf], num_ps=16, min_shard_bytes=1 << 21).shards) == 1


def test_placement_map_round_trips_through_json() -> None:
    result = placement.plan(_many_leaves(), num_ps=3)
    restored = placement.Placement.from_dict(json.loads(json.dumps(result.to_dict())))
    assert restored == result


def test_partition_round_trip_rebuilds_every_leaf_from_its_shards() -> None:
    rng = np.random.default_rng(0)
    tree: dict[str, Any] = {
        "embedding": rng.standard_normal((5000, 64)).astype(np.float32),
        "dense": {"kernel": rng.standard_normal((128, 10)), "bias": np.arange(10, dtype=np.int32)},
        "step_scale": np.float32(3.0),
    }
    layout, named = placement.named_leaves(tree)
    result = placement.plan(placement.variables_of(tree), num_ps=3, min_shard_bytes=100_000)
    assert len(result.shards_of("['embedding']")) == 3
    rebuilt = {}
    for var in result.variables:
        source = np.ascontiguousarray(named[var.name])
        out = np.empty_like(source)
        for shard in result.shards_of(var.name):
            raw = source.reshape(-1).view(np.uint8)[
                shard.byte_offset : shard.byte_offset + shard.nbytes
            ]
            piece = raw.view(source.dtype).reshape(shard.shape)
            if var.shape:
                assert np.array_equal(piece, source[shard.start : shard.stop])
            out.reshape(-1).view(np.uint8)[shard.byte_offset : shard.byte_offset + shard.nbytes] = (
                raw
            )
        rebuilt[var.name] = out
    again = layout.unflatten(rebuilt)
    assert np.array_equal(again["embedding"], tree["embedding"])
    assert np.array_equal(again["dense"]["kernel"], tree["dense"]["kernel"])
    assert again["dense"]["bias"].dtype == np.int32
    assert again["step_scale"] == np.float32(3.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ps": 0}, "num_ps: got 0"),
        ({"num_ps": 2, "strategy": "random"}, "allowed: greedy, roundRobin"),
        ({"num_ps": 2, "min_shard_bytes": 0}, "minShardBytes"),
    ],
    ids=["no-ps", "unknown-strategy", "zero-min-shard-bytes"],
)
def test_bad_placement_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(placement.PlacementError, match=message):
        placement.plan([Variable("w", (4,), "float32")], **kwargs)  # type: ignore[arg-type]


def test_duplicate_variable_names_are_refused() -> None:
    with pytest.raises(placement.PlacementError, match="'w' appears twice"):
        placement.plan([Variable("w", (4,), "float32")] * 2, num_ps=1)


def test_a_layout_names_the_leaves_of_any_tree_of_its_structure() -> None:
    params = {"dense": {"w": np.zeros((2, 3)), "b": np.zeros(3)}, "out": [np.ones(1)]}
    layout, named = placement.named_leaves(params)
    grads = {"dense": {"w": np.full((2, 3), 2.0), "b": np.full(3, 3.0)}, "out": [np.full(1, 4.0)]}
    again = layout.named(grads)
    assert list(again) == list(named) == ["['dense']['b']", "['dense']['w']", "['out'][0]"]
    assert again["['out'][0]"][0] == 4.0
    # another structure: named afresh, not with the layout's names
    assert list(layout.named({"x": np.zeros(1)})) == ["['x']"]
    assert Variable("w", (2, 3), "float32").nbytes == 24
    assert Variable("s", (), "bfloat16").nbytes == 2
