"""A ps's data positions: each batch of a data shard is claimed by one push at a time, applied
once, only in order, and only by the newest lease of its shard; positions move when a push
counts (`settle`) and start over from what a bring-up gives (`reset`). Pure: no store, no
lock, no gRPC."""

from __future__ import annotations

import pytest

from jaxps_runtime.ps.positions import Claim, InvalidPositionError, Positions
from jaxps_runtime.wire import terms


def _claimed(positions: Positions, *, shard: str, cursor: int, lease: int) -> Claim:
    claim = positions.claim(shard=shard, cursor=cursor, lease=lease)
    assert isinstance(claim, Claim), claim
    return claim


def _refusal(positions: Positions, *, shard: str, cursor: int, lease: int) -> str:
    refused = positions.claim(shard=shard, cursor=cursor, lease=lease)
    assert isinstance(refused, str), refused
    return refused


def test_the_first_batch_of_a_shard_is_claimed_and_moves_nothing_until_it_counts() -> None:
    positions = Positions()
    claim = _claimed(positions, shard="0:3", cursor=1, lease=7)
    assert claim == Claim("0:3", 1, 7)
    assert positions.snapshot() == {}  # in flight: not applied yet
    positions.settle([claim])
    assert positions.snapshot() == {"0:3": 1}


def test_a_batch_applied_here_is_refused_as_applied() -> None:
    positions = Positions()
    positions.settle([_claimed(positions, shard="0:3", cursor=1, lease=7)])
    refused = _refusal(positions, shard="0:3", cursor=1, lease=7)
    assert terms.refusal_word(refused) == terms.APPLIED
    assert "batch 0 of shard 0:3 is applied here" in refused
    # The same batch pushed by a newer holder (the one before crashed after this ps took it)
    assert terms.refusal_word(_refusal(positions, shard="0:3", cursor=1, lease=8)) == terms.APPLIED


def test_a_batch_after_a_missing_one_is_refused_as_a_gap() -> None:
    positions = Positions({"0:3": 1})
    refused = _refusal(positions, shard="0:3", cursor=3, lease=7)
    assert terms.refusal_word(refused) == terms.GAP
    assert "batch 2 of shard 0:3, but only 1 of its batches are applied here" in refused
    assert positions.snapshot() == {"0:3": 1}
    _claimed(positions, shard="0:3", cursor=2, lease=7)  # the missing one is what comes next


@pytest.mark.parametrize(
    "shard",
    ["worker-0", "0:x", "3", "-1:2", "1:\u00b2", "1:\u0661", "1:" + "1" * 19, "", ":"],
    ids=[
        "a-worker",
        "not-a-number",
        "no-colon",
        "negative-epoch",
        "superscript-digit",
        "arabic-indic-digit",
        "19-digits",
        "empty",
        "colon-only",
    ],
)
def test_a_shard_that_is_no_shard_key_is_invalid(shard: str) -> None:
    with pytest.raises(InvalidPositionError, match="is no data shard"):
        Positions().claim(shard=shard, cursor=1, lease=1)


@pytest.mark.parametrize("cursor", [0, -4])
def test_a_cursor_before_the_first_batch_is_refused_as_a_gap(cursor: int) -> None:
    refused = _refusal(Positions(), shard="0:1", cursor=cursor, lease=1)
    assert terms.refusal_word(refused) == terms.GAP
    assert "is no position of a data shard" in refused


def test_a_batch_being_applied_is_refused_as_busy_until_it_is_dropped() -> None:
    positions = Positions()
    claim = _claimed(positions, shard="1:0", cursor=1, lease=4)
    refused = _refusal(positions, shard="1:0", cursor=1, lease=4)
    assert terms.refusal_word(refused) == terms.BUSY
    assert "batch 0 of shard 1:0 is being applied" in refused
    positions.drop(claim)  # the push failed: the batch is free again, its position unmoved
    assert positions.snapshot() == {}
    assert _claimed(positions, shard="1:0", cursor=1, lease=4) == claim
    positions.drop(None)  # a push that claimed nothing drops nothing


def test_a_lease_older_than_the_newest_that_pushed_the_shard_is_revoked() -> None:
    positions = Positions()
    positions.settle([_claimed(positions, shard="0:2", cursor=1, lease=10)])
    newer = _claimed(positions, shard="0:2", cursor=2, lease=11)  # the shard was re-leased
    positions.settle([newer])
    refused = _refusal(positions, shard="0:2", cursor=3, lease=10)  # the old holder, a zombie
    assert terms.refusal_word(refused) == terms.REVOKED
    assert "lease 10 of shard 0:2 was taken back (11 holds it)" in refused
    # Revoked before anything else: even a batch the old lease would find applied
    assert terms.refusal_word(_refusal(positions, shard="0:2", cursor=1, lease=10)) == (
        terms.REVOKED
    )
    # A claim fences as soon as it is made, before it counts
    positions.drop(_claimed(positions, shard="0:2", cursor=3, lease=12))
    assert terms.refusal_word(_refusal(positions, shard="0:2", cursor=3, lease=11)) == (
        terms.REVOKED
    )
    # Leases are per shard: another shard knows nothing of them
    _claimed(positions, shard="0:5", cursor=1, lease=1)


def test_a_refused_claim_takes_no_lease() -> None:
    positions = Positions({"0:2": 1})
    assert terms.refusal_word(_refusal(positions, shard="0:2", cursor=5, lease=30)) == terms.GAP
    _claimed(positions, shard="0:2", cursor=2, lease=20)  # 30 never held the shard here


def test_settle_moves_each_shard_to_its_claims_position_and_never_back() -> None:
    positions = Positions()
    first = _claimed(positions, shard="0:0", cursor=1, lease=1)
    other = _claimed(positions, shard="0:1", cursor=1, lease=2)
    positions.settle([first, other])  # a sync step: every contributor's batch at once
    assert positions.snapshot() == {"0:0": 1, "0:1": 1}
    positions.settle([first])  # settled again (a retry): nothing moves back or on
    assert positions.snapshot() == {"0:0": 1, "0:1": 1}
    positions.settle([])  # a push with no batch (the chief's, an empty worker's)
    assert positions.snapshot() == {"0:0": 1, "0:1": 1}


def test_a_push_of_a_newer_data_epoch_forgets_the_older_epochs_positions() -> None:
    positions = Positions({"0:0": 4, "0:1": 4, "1:0": 2})
    positions.settle([_claimed(positions, shard="2:7", cursor=1, lease=9)])
    assert positions.snapshot() == {"2:7": 1}
    # The older epochs' leases are forgotten with them
    positions.settle([_claimed(positions, shard="3:0", cursor=1, lease=1)])
    assert positions.snapshot() == {"3:0": 1}


def test_a_push_of_epoch_0_forgets_nothing() -> None:
    positions = Positions({"0:0": 4})
    positions.settle([_claimed(positions, shard="0:1", cursor=1, lease=9)])
    assert positions.snapshot() == {"0:0": 4, "0:1": 1}


def test_a_push_of_a_forgotten_older_epoch_is_never_applied_again() -> None:
    positions = Positions()
    positions.settle([_claimed(positions, shard="0:4", cursor=1, lease=3)])
    positions.settle([_claimed(positions, shard="1:0", cursor=1, lease=9)])
    # lease 3 held shard 0:4 of epoch 0 and was taken back; it still pushes batch 0
    assert isinstance(positions.claim(shard="0:4", cursor=1, lease=3), str)


def test_reset_starts_over_from_the_positions_given() -> None:
    positions = Positions()
    for cursor in (1, 2, 3):
        positions.settle([_claimed(positions, shard="1:1", cursor=cursor, lease=50)])
    _claimed(positions, shard="1:1", cursor=4, lease=50)  # in flight when the ps is restored
    positions.reset({"1:1": 3, "1:2": 0, "worker-0": 12, "junk": 1})
    assert positions.snapshot() == {"1:1": 3, "1:2": 0}  # only positions of data shards
    # Nothing in flight, no lease known: a bring-up voided them (the queue leases anew)
    assert _claimed(positions, shard="1:1", cursor=4, lease=1) == Claim("1:1", 4, 1)
    assert terms.refusal_word(_refusal(positions, shard="1:1", cursor=3, lease=1)) == (
        terms.APPLIED
    )
    positions.reset({})
    assert positions.snapshot() == {}


def test_a_snapshot_is_a_copy() -> None:
    positions = Positions({"0:0": 2})
    positions.snapshot()["0:0"] = 99
    assert positions.snapshot() == {"0:0": 2}
