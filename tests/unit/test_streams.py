"""Tensor streams: chunking and reassembly, with errors that name the tensor."""

from __future__ import annotations

import numpy as np
import pytest

from jaxps.v1 import tensor_pb2
from jaxps_runtime import codec, streams


def _specs() -> list[streams.Spec]:
    return [
        streams.Spec("a", (1000,), np.dtype(np.float32)),
        streams.Spec("b", (0,), np.dtype(np.float32)),
        streams.Spec("c", (3, 2), np.dtype(np.int64)),
    ]


def test_frames_reassemble_into_the_same_arrays() -> None:
    arrays: list[np.ndarray] = [
        np.arange(1000, dtype=np.float32),
        np.zeros(0, np.float32),
        np.arange(6, dtype=np.int64).reshape(3, 2),
    ]
    header = tensor_pb2.FrameHeader(tensors=[s.to_proto() for s in _specs()])
    raws = list(streams.frames(header, (streams.byte_view(a) for a in arrays), chunk_bytes=512))
    assert len(raws) == 8 + 1 + 1  # 4000 bytes in 512-byte chunks, one empty, one small
    got_header, first = streams.read_header(iter(raws))
    assert got_header == header
    assembler = streams.Assembler(_specs())
    for decoded in [first, *streams.decode_all(iter(raws[1:]))]:
        assembler.add(decoded)
    assert assembler.missing() == []
    for i, expected in enumerate(arrays):
        assert np.array_equal(assembler.array(i), expected)


def _chunk(tensor: int, offset: int, data: bytes) -> codec.Decoded:
    return codec.decode(codec.encode(tensor_pb2.Frame(tensor=tensor, offset=offset), data))


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([(7, 0, b"x")], "tensor #7; the header declares 3 tensors"),
        ([(0, 4, b"abcd")], "tensor 'a': chunk at byte 4, expected byte 0"),
        ([(2, 0, b"\0" * 56)], "tensor 'c': chunk ends at byte 56, past its 48 bytes"),
        ([(2, 0, b"\0" * 48), (2, 48, b"")], "tensor 'c': chunk after the tensor was complete"),
    ],
    ids=["unknown-index", "out-of-order", "past-the-end", "after-complete"],
)
def test_protocol_breaks_name_the_tensor(
    chunks: list[tuple[int, int, bytes]], message: str
) -> None:
    assembler = streams.Assembler(_specs())
    *fine, bad = [_chunk(tensor, offset, data) for tensor, offset, data in chunks]
    for decoded in fine:
        assembler.add(decoded)
    with pytest.raises(streams.StreamError, match=message):
        assembler.add(bad)


def test_unknown_dtype_lists_the_allowed_ones() -> None:
    with pytest.raises(streams.StreamError, match="allowed: float32, float64"):
        streams.Spec.from_proto(tensor_pb2.TensorSpec(name="w", dtype="complex64"), where="x")


def test_a_stream_without_a_header_is_refused() -> None:
    raw = codec.encode(tensor_pb2.Frame(tensor=0), b"abcd")
    with pytest.raises(streams.StreamError, match="frame 0 has no header"):
        streams.read_header(iter([raw]))


def test_an_empty_stream_is_refused() -> None:
    with pytest.raises(streams.StreamError, match="empty stream"):
        streams.read_header(iter([]))
