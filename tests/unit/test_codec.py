"""The frame codec writes and reads exactly protobuf's wire format, without copying data."""

from __future__ import annotations

import numpy as np
import pytest

from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire import codec


def _header() -> tensor_pb2.FrameHeader:
    return tensor_pb2.FrameHeader(
        id=tensor_pb2.Identity(job_id="j", ps_incarnation=7, cluster_epoch=3, task="worker-1"),
        step=12,
        tensors=[tensor_pb2.TensorSpec(name="['w']/0", shape=[4, 2], dtype="float32")],
        push_id="abc",
    )


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 1 << 20])
def test_encode_matches_protobuf_byte_for_byte(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    frame = tensor_pb2.Frame(header=_header(), offset=4096)
    reference = tensor_pb2.Frame(header=_header(), offset=4096, data=data)
    assert codec.encode(frame, memoryview(data)) == reference.SerializeToString()


def test_decode_returns_a_view_of_the_received_bytes() -> None:
    data = np.arange(1000, dtype=np.float32).tobytes()
    raw = tensor_pb2.Frame(header=_header(), offset=8, data=data).SerializeToString()
    decoded = codec.decode(raw)
    assert decoded.frame.header == _header()
    assert decoded.frame.offset == 8
    assert decoded.data.obj is raw  # no copy
    assert np.array_equal(np.frombuffer(decoded.data, np.float32), np.arange(1000))


def test_decode_accepts_data_before_other_fields() -> None:
    # Protobuf allows any field order; a peer that writes data first still decodes.
    data = b"\x01\x02\x03\x04"
    rest = tensor_pb2.Frame(offset=4).SerializeToString()
    raw = bytes([(15 << 3) | 2, 4]) + data + rest
    decoded = codec.decode(raw)
    assert bytes(decoded.data) == data
    assert decoded.frame.offset == 4


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x7a\x05ab", "runs past the end"),
        (b"\x10\xff", "varint"),
        (b"\x0f", "unsupported wire type"),
        (b"\x00\x01", "field number 0"),
    ],
    ids=["truncated-data", "truncated-varint", "bad-wire-type", "field-zero"],
)
def test_decode_rejects_malformed_frames(raw: bytes, message: str) -> None:
    with pytest.raises(codec.CodecError, match=message):
        codec.decode(raw)
