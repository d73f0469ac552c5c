"""Zero-copy encoding of `jaxps.v1.Frame`, the message every tensor stream is made of.

The wire format is plain protobuf: any protobuf library can read and write these frames. This
module only avoids the copies a generic protobuf library makes of the `data` field (one on
serialize, one on parse and one more on every attribute access with upb):

- `encode` serializes the small fields with protobuf and appends field 15 (`data`) by hand, so the
  payload is copied once, into the message bytes grpc sends.
- `decode` walks the top-level fields of the received bytes, hands the small prefix to protobuf and
  returns `data` as a `memoryview` into the received buffer, ready for `np.frombuffer`.

Field 15 is the highest field number of `Frame`, so protobuf serializers put it last; when a peer
puts it elsewhere, `decode` falls back to protobuf's own parser (correct, one copy slower).

Pure functions, thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from google.protobuf.message import DecodeError

from jaxps.v1 import tensor_pb2

DATA_FIELD = 15
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_DATA_KEY = bytes([(DATA_FIELD << 3) | _WIRE_LEN])


class CodecError(ValueError):
    """Received bytes are not a valid `jaxps.v1.Frame`."""


class Decoded(NamedTuple):
    """A received frame: its small fields, and its payload as a view into the received bytes."""

    frame: tensor_pb2.Frame
    data: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    end = len(buf)
    while pos < end:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise CodecError(f"truncated or overlong varint at byte {pos}")


def encode(frame: tensor_pb2.Frame, data: bytes | memoryview = b"") -> bytes:
    """Serializes `frame` with `data` as its payload (`frame.data` must be left empty)."""
    return encode_parts(frame, (data,))


def encode_parts(frame: tensor_pb2.Frame, parts: Sequence[bytes | memoryview]) -> bytes:
    """Serializes `frame` with the concatenation of `parts` as its payload, copying each part
    once (into the message bytes)."""
    prefix = frame.SerializeToString()
    size = sum(len(p) for p in parts)
    if not size:
        return prefix
    return b"".join((prefix, _DATA_KEY, _varint(size), *parts))


def decode(raw: bytes) -> Decoded:
    """Parses one frame; `data` is a zero-copy view of `raw` (keep `raw` alive while using it)."""
    pos, end = 0, len(raw)
    data_key_at = data_start = data_stop = -1
    data_fields = 0
    while pos < end:
        key_at = pos
        key, pos = _read_varint(raw, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise CodecError(f"field number 0 at byte {key_at}")
        if wire == _WIRE_VARINT:
            _, pos = _read_varint(raw, pos)
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(raw, pos)
            if field == DATA_FIELD:
                data_key_at, data_start, data_stop = key_at, pos, pos + length
                data_fields += 1
            pos += length
        elif wire == _WIRE_I64:
            pos += 8
        elif wire == _WIRE_I32:
            pos += 4
        else:
            raise CodecError(f"unsupported wire type {wire} for field {field} at byte {key_at}")
        if pos > end:
            raise CodecError(f"field {field} runs past the end of the frame ({pos} > {end} bytes)")
    try:
        if data_fields == 0:
            return Decoded(tensor_pb2.Frame.FromString(raw), memoryview(b""))
        if data_fields == 1 and data_stop == end:
            frame = tensor_pb2.Frame.FromString(raw[:data_key_at])
            return Decoded(frame, memoryview(raw)[data_start:data_stop])
        # `data` is not last, or repeated (last one wins): let protobuf sort it out.
        frame = tensor_pb2.Frame.FromString(raw)
        data = frame.data
        frame.ClearField("data")
        return Decoded(frame, memoryview(data))
    except DecodeError as err:
        raise CodecError(f"not a jaxps.v1.Frame: {err}") from err
