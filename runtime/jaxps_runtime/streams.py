"""Tensor streams: cutting tensors into ~1 MiB `Frame`s and putting them back together.

Both ends use these: the client to push and the ps to pull (`frames`), the ps to receive pushes
and the client to receive pulls (`Assembler`). Chunks of one tensor arrive in order; any other
order, a chunk out of bounds or misaligned, or an unknown tensor index is a `StreamError` whose
message names the tensor, so a bad peer gets INVALID_ARGUMENT and nothing half-written is used.

Not thread-safe: one `Assembler` per stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from jaxps.v1 import tensor_pb2
from jaxps_runtime import codec

CHUNK_BYTES = 1 << 20

DTYPES: dict[str, np.dtype[np.generic]] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}


class StreamError(ValueError):
    """A tensor stream broke the protocol; the message says where and how."""


def dtype_of(name: str, *, where: str = "dtype") -> np.dtype[np.generic]:
    try:
        return DTYPES[name]
    except KeyError:
        raise StreamError(f"{where}: got {name!r}; allowed: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class Spec:
    """A validated `TensorSpec`."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # math.prod: ~20x np.prod on tuples

    @classmethod
    def from_proto(cls, msg: tensor_pb2.TensorSpec, *, where: str) -> Spec:
        if not msg.name:
            raise StreamError(f"{where}.name: empty; expected a shard name")
        if any(d < 0 for d in msg.shape):
            raise StreamError(f"{where}.shape: got {list(msg.shape)}; dimensions must be >= 0")
        return cls(msg.name, tuple(msg.shape), dtype_of(msg.dtype, where=f"{where}.dtype"))

    def to_proto(self, *, rows: bytes = b"") -> tensor_pb2.TensorSpec:
        return tensor_pb2.TensorSpec(
            name=self.name, shape=self.shape, dtype=self.dtype.name, rows=rows
        )


def byte_view(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array, without copying."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8).data


def frames(
    header: tensor_pb2.FrameHeader,
    buffers: Iterable[memoryview],
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[bytes]:
    """Encoded frames carrying `buffers` in order; the header rides on the first frame."""
    first: tensor_pb2.FrameHeader | None = header
    for index, buf in enumerate(buffers):
        size = len(buf)
        for offset in range(0, max(size, 1), chunk_bytes):
            frame = tensor_pb2.Frame(tensor=index, offset=offset)
            if first is not None:
                frame.header.CopyFrom(first)
                first = None
            yield codec.encode(frame, buf[offset : offset + chunk_bytes])
    if first is not None:  # no tensors at all: the header alone
        yield codec.encode(tensor_pb2.Frame(header=first))


def pack(header: tensor_pb2.FrameHeader, buffers: Iterable[memoryview]) -> bytes:
    """One frame carrying `header` and every buffer back to back (PushPull's packed form)."""
    return codec.encode_parts(tensor_pb2.Frame(header=header), list(buffers))


def unpack(data: memoryview, specs: Sequence[Spec], *, where: str) -> list[memoryview]:
    """The bytes of each tensor in a packed frame's `data`; the sizes must add up exactly."""
    need = sum(spec.nbytes for spec in specs)
    if len(data) != need:
        raise StreamError(
            f"{where}: the frame carries {len(data)} bytes; its {len(specs)} tensors need {need}"
        )
    views, at = [], 0
    for spec in specs:
        views.append(data[at : at + spec.nbytes])
        at += spec.nbytes
    return views


def read_header(raw_frames: Iterator[bytes]) -> tuple[tensor_pb2.FrameHeader, codec.Decoded]:
    """The header of a stream and its first frame (which may carry a chunk too)."""
    try:
        raw = next(raw_frames)
    except StopIteration:
        raise StreamError("empty stream; expected a first frame with a header") from None
    try:
        first = codec.decode(raw)
    except codec.CodecError as err:
        raise StreamError(f"frame 0: {err}") from err
    if not first.frame.HasField("header"):
        raise StreamError("frame 0 has no header; the first frame of a stream must carry one")
    return first.frame.header, first


class Assembler:
    """Puts chunks back into whole tensors, in place into given buffers or into new ones."""

    def __init__(
        self,
        specs: Sequence[Spec],
        *,
        into: Sequence[np.ndarray | None] | None = None,
        allocate: Callable[[Spec], np.ndarray] | None = None,
    ) -> None:
        self.specs = tuple(specs)
        self._allocate = allocate
        self._received = [0] * len(self.specs)
        self._arrays: list[np.ndarray | None] = list(into) if into else [None] * len(self.specs)
        self._complete = [False] * len(self.specs)
        self.bytes = 0

    def add(self, decoded: codec.Decoded) -> int | None:
        """Takes one chunk; returns the index of the tensor it completed, if it did."""
        frame, data = decoded
        index = frame.tensor
        if index >= len(self.specs):
            raise StreamError(
                f"chunk for tensor #{index}; the header declares {len(self.specs)} tensors"
            )
        spec = self.specs[index]
        if self._complete[index]:
            raise StreamError(f"tensor {spec.name!r}: chunk after the tensor was complete")
        size = len(data)
        if frame.offset != self._received[index]:
            raise StreamError(
                f"tensor {spec.name!r}: chunk at byte {frame.offset}, expected byte "
                f"{self._received[index]} (chunks of a tensor arrive in order)"
            )
        end = frame.offset + size
        if end > spec.nbytes:
            raise StreamError(
                f"tensor {spec.name!r}: chunk ends at byte {end}, past its {spec.nbytes} bytes"
            )
        out = self._arrays[index]
        if out is None and size == spec.nbytes:
            # The whole tensor in one chunk: a zero-copy view of the received bytes.
            self._arrays[index] = np.frombuffer(data, dtype=spec.dtype).reshape(spec.shape)
        else:
            if out is None:
                if self._allocate:
                    out = self._allocate(spec)
                else:
                    out = np.empty(spec.shape, dtype=spec.dtype)
                self._arrays[index] = out
            flat = out.reshape(-1).view(np.uint8)
            flat[frame.offset : end] = np.frombuffer(data, dtype=np.uint8)
        self._received[index] = end
        self.bytes += size
        if end == spec.nbytes:
            self._complete[index] = True
            return index
        return None

    def array(self, index: int) -> np.ndarray:
        out = self._arrays[index]
        if out is None or not self._complete[index]:
            raise StreamError(f"tensor {self.specs[index].name!r} is not complete")
        return out

    def missing(self) -> list[str]:
        """Tensors not complete, as "name (got/total bytes)"."""
        return [
            f"{s.name!r} ({self._received[i]}/{s.nbytes} bytes)"
            for i, s in enumerate(self.specs)
            if not self._complete[i]
        ]


def decode_all(raw_frames: Iterator[bytes], *, start: int = 1) -> Iterator[codec.Decoded]:
    """Decodes the remaining frames of a stream, naming the frame number on error."""
    for number, raw in enumerate(raw_frames, start=start):
        try:
            yield codec.decode(raw)
        except codec.CodecError as err:
            raise StreamError(f"frame {number}: {err}") from err
