"""`wire.inflight`'s bookkeeping: a caller's share of calls, and a reply stream that frees its
call once, however it ends. (Stalled streams are cancelled over real gRPC in
tests/process/test_attacks_held.py.)"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from jaxps_runtime.wire import inflight


def test_a_caller_past_its_share_is_refused_and_others_are_not() -> None:
    calls = inflight.InFlight(most=2)
    calls.enter("jaxps://job/worker/1")
    calls.enter("jaxps://job/worker/1")
    with pytest.raises(inflight.TooManyCallsError, match="worker/1 has 2 calls in flight"):
        calls.enter("jaxps://job/worker/1")
    calls.enter("jaxps://job/worker/0")  # another caller's share is its own
    calls.leave("jaxps://job/worker/1")
    calls.enter("jaxps://job/worker/1")  # one ended: one more may start


@pytest.mark.parametrize("how", ["read to the end", "failed", "dropped unread"])
def test_a_reply_stream_frees_its_call_once(how: str) -> None:
    ended: list[int] = []

    def replies() -> Iterator[int]:
        yield 1
        if how == "failed":
            raise RuntimeError("the servicer failed")
        yield 2

    stream = inflight.Replies(replies(), lambda: ended.append(1))
    if how == "read to the end":
        assert list(stream) == [1, 2]
    elif how == "failed":
        with pytest.raises(RuntimeError):
            list(stream)
    del stream
    gc.collect()
    assert ended == [1]
