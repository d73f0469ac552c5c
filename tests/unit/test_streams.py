"""Tensor streams: packed and streamed framing, reassembly, and errors that say what was wrong."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire import codec, streams


def _specs() -> list[streams.Spec]:
    return [
        streams.Spec("a", (1000,), np.dtype(np.float32)),
        streams.Spec("b", (0,), np.dtype(np.float32)),
        streams.Spec("c", (3, 2), np.dtype(np.int64)),
    ]


def _arrays() -> list[np.ndarray]:
    return [
        np.arange(1000, dtype=np.float32),
        np.zeros(0, np.float32),
        np.arange(6, dtype=np.int64).reshape(3, 2),
    ]


def _read(raws: list[bytes], **kwargs: object) -> tuple[streams.Assembler, list[range]]:
    _, assembler, fill = streams.receive(iter(raws), where="test", **kwargs)  # type: ignore[arg-type]
    return assembler, list(fill)


@pytest.mark.parametrize("chunk", [1, 3, 512, 4000, 4048, 1 << 20])
def test_frames_reassemble_into_the_same_arrays(chunk: int) -> None:
    header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in _specs()])
    views = [streams.byte_view(a) for a in _arrays()]
    raws = list(streams.frames(header, views, chunk_bytes=chunk))
    assert len(raws) == -(-4048 // chunk)  # windows span tensors; the last may be short
    assert streams.read_header(iter(raws))[0] == header
    assembler, completed = _read(raws)
    assert [i for done in completed for i in done] == [0, 1, 2]  # each completed once, in order
    assert assembler.missing() == []
    for i, expected in enumerate(_arrays()):
        assert np.array_equal(assembler.array(i), expected)


def test_a_packed_stream_is_one_frame_read_without_copies() -> None:
    header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in _specs()])
    raw = streams.pack(header, [streams.byte_view(a) for a in _arrays()])
    assembler, completed = _read([raw])
    assert completed == [range(0, 3)]
    assert assembler.array(0).base is not None  # a view of the received bytes
    assert np.array_equal(assembler.array(2), _arrays()[2])


def test_a_stream_fills_the_buffers_it_is_given() -> None:
    header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in _specs()])
    raws = list(streams.frames(header, [streams.byte_view(a) for a in _arrays()], chunk_bytes=7))
    target = np.zeros(1000, np.float32)
    assembler, _ = _read(raws, into=[target, None, None])
    assert assembler.array(0) is target
    assert np.array_equal(target, _arrays()[0])


def test_a_stream_of_other_tensors_than_expected_is_refused() -> None:
    header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in _specs()])
    raw = streams.pack(header, [streams.byte_view(a) for a in _arrays()])
    with pytest.raises(streams.StreamError, match=r"carries a float32\[1000\].*expected a"):
        _read([raw], expect=_specs()[:1])


def test_up_to_takes_fewer_rows_of_those_tensors_but_never_more_or_another_width() -> None:
    """A dynamic table's reply rows: the resident ones of those asked (`up_to`)."""
    expected = [
        streams.Spec("a", (1000,), np.dtype(np.float32)),
        streams.Spec("c", (5, 2), np.dtype(np.int64)),
    ]

    def stream(rows: int, width: int = 2) -> bytes:
        arrays = [_arrays()[0], np.zeros((rows, width), np.int64)]
        specs = [
            streams.Spec("a", (1000,), np.dtype(np.float32)),
            streams.Spec("c", (rows, width), np.dtype(np.int64)),
        ]
        header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in specs])
        return streams.pack(header, [streams.byte_view(a) for a in arrays])

    for rows in (0, 3, 5):
        assembler, _ = _read([stream(rows)], expect=expected, up_to=[1])
        assert assembler.array(1).shape == (rows, 2)
    for bad in (stream(6), stream(3, width=3)):
        with pytest.raises(streams.StreamError, match="expected"):
            _read([bad], expect=expected, up_to=[1])
    with pytest.raises(streams.StreamError, match="expected"):  # not of `up_to`: exact
        _read([stream(3)], expect=expected)


def _frame(offset: int, data: bytes) -> codec.Decoded:
    return codec.decode(codec.encode(tensor_pb2.Frame(offset=offset), data))


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([(4, b"abcd")], "frame at byte 4, expected byte 0"),
        ([(0, b"abcd"), (0, b"abcd")], "frame at byte 0, expected byte 4"),
        ([(0, b"\0" * 4049)], "frames carry 4049 bytes; the header's 3 tensors hold 4048"),
    ],
    ids=["gap", "repeated", "past-the-end"],
)
def test_protocol_breaks_say_what_was_wrong(frames: list[tuple[int, bytes]], message: str) -> None:
    assembler = streams.Assembler(_specs())
    *fine, bad = [_frame(offset, data) for offset, data in frames]
    for decoded in fine:
        assembler.add(decoded)
    with pytest.raises(streams.StreamError, match=message):
        assembler.add(bad)


def test_a_short_stream_names_what_is_missing() -> None:
    assembler = streams.Assembler(_specs())
    assembler.add(_frame(0, b"\0" * 3000))
    assert assembler.missing() == ["'a' (3000/4000 bytes)", "'b' (0/0 bytes)", "'c' (0/48 bytes)"]
    with pytest.raises(streams.StreamError, match="'a' is not complete"):
        assembler.array(0)


def test_unknown_dtype_lists_the_allowed_ones() -> None:
    with pytest.raises(streams.StreamError, match="allowed: float32, float64"):
        streams.Spec.from_proto(tensor_pb2.TensorSpec(name="w", dtype="complex64"), where="x")


def test_a_stream_without_a_header_is_refused() -> None:
    raw = codec.encode(tensor_pb2.Frame(offset=0), b"abcd")
    with pytest.raises(streams.StreamError, match="frame 0 has no header"):
        streams.read_header(iter([raw]))


def test_an_empty_stream_is_refused() -> None:
    with pytest.raises(streams.StreamError, match="empty stream"):
        streams.read_header(iter([]))


@pytest.mark.parametrize("shape", [(0,), (3,), (1000, 7), (2048, 2048)])
def test_received_tensors_land_in_64_byte_aligned_arrays(shape: tuple[int, ...]) -> None:
    # XLA's CPU client reads an aligned host array in place; numpy's own are 16-byte aligned.
    array = streams.empty(shape, np.dtype(np.float32))
    assert array.shape == shape
    assert array.dtype == np.float32
    assert array.flags.c_contiguous
    assert streams.aligned(array)
    header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in _specs()])
    raw = streams.pack(header, [streams.byte_view(a) for a in _arrays()])
    assembler, _ = _read([raw], allocate=lambda s: streams.empty(s.shape, s.dtype))
    assert all(streams.aligned(assembler.array(i)) for i in (0, 2))
    assert np.array_equal(assembler.array(2), _arrays()[2])


class _BytesDirect(streams.Direct):
    """A `Direct` stream over bytes in memory (the bulk path reads a socket instead)."""

    def __init__(self, header: tensor_pb2.FrameHeader, data: bytes) -> None:
        self.header, self.nbytes, self._data, self.reads = header, len(data), data, 0

    def readinto(self, view: memoryview) -> None:
        view[:] = self._data[: len(view)]
        self._data = self._data[len(view) :]
        self.reads += 1


def test_a_direct_stream_reads_each_tensor_straight_into_its_array() -> None:
    header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in _specs()])
    data = b"".join(a.tobytes() for a in _arrays())
    source = _BytesDirect(header, data)
    target = np.zeros(1000, np.float32)
    got, assembler, fill = streams.receive(source, where="test", into=[target, None, None])
    assert got is header
    assert list(fill) == [range(0, 1), range(1, 2), range(2, 3)]
    assert source.reads == 2  # one read per tensor with bytes, none for the empty one
    assert assembler.array(0) is target
    assert assembler.missing() == []
    for i, expected in enumerate(_arrays()):
        assert np.array_equal(assembler.array(i), expected)
    assert streams.aligned(assembler.array(2))


def test_a_direct_stream_of_other_than_its_tensors_bytes_is_refused() -> None:
    header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in _specs()])
    source = _BytesDirect(header, b"\0" * 4047)
    _, _, fill = streams.receive(source, where="test")
    with pytest.raises(
        streams.StreamError, match="carries 4047 bytes; the header's 3 tensors hold 4048"
    ):
        list(fill)


def test_first_duplicate_names_the_first_name_seen_twice() -> None:
    assert streams.first_duplicate(["a", "b", "c"]) is None
    assert streams.first_duplicate(["a", "b", "c", "b", "a"]) == "b"
    assert streams.first_duplicate([]) is None


def test_first_duplicate_is_linear_in_the_names_a_peer_sends() -> None:
    names = [f"n{i}" for i in range(200_000)] + ["n199999"]  # the repeat comes last
    started = time.process_time()
    assert streams.first_duplicate(names) == "n199999"
    assert time.process_time() - started < 0.5  # quadratic: minutes


def test_a_header_of_more_tensors_than_allowed_is_refused_before_its_specs_are_made() -> None:
    header = tensor_pb2.FrameHeader(
        tensors=[tensor_pb2.TensorSpec(name=f"t{i}", shape=[1], dtype="nope") for i in range(3)]
    )
    source = _BytesDirect(header, b"")
    with pytest.raises(
        streams.TooManyTensorsError, match=r"Update.tensors: 3 tensors; at most 2"
    ) as caught:
        streams.receive(source, where="Update", most=2)  # the bad dtypes are never looked at
    assert caught.value.header is header
