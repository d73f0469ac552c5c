"""What the bulk path lets a call claim: at most what the ps's shards could ever need."""

from __future__ import annotations

import numpy as np

from jaxps_runtime.ps import checks as ps
from jaxps_runtime.wire import bulk, streams


def spec(*shape: int) -> streams.Spec:
    return streams.Spec("s", shape, np.dtype(np.float32))


def test_the_bulk_path_allows_the_rows_the_ps_itself_allows() -> None:
    assert bulk.ROWS_PER_TENSOR == ps.ROWS_PER_TENSOR


def test_a_small_table_may_still_get_a_batch_of_repeated_row_ids() -> None:
    bounds = bulk.Bounds.of([spec(10, 4)])
    assert bounds.message_bytes >= 8 * ps.ROWS_PER_TENSOR
    assert bounds.tensor_bytes >= ps.ROWS_PER_TENSOR * 4 * 4


def test_bounds_grow_with_the_shards_and_stop_at_the_largest_message() -> None:
    small, large = bulk.Bounds.of([spec(1 << 16)]), bulk.Bounds.of([spec(1 << 24, 8)])
    assert small.message_bytes < large.message_bytes
    assert small.tensor_bytes < large.tensor_bytes
    assert large.tensor_bytes >= 2 * (1 << 24) * 8 * 4
    assert bulk.Bounds.of([spec(1 << 40)]).message_bytes == bulk.MAX_MESSAGE_BYTES
    assert bulk.Bounds.of([]).message_bytes == bulk.SMALL_MESSAGE_BYTES
