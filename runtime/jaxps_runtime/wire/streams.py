"""Tensor streams: a header naming tensors, then their bytes back to back, in `Frame`s.

A stream is packed (`pack`: one frame carries every byte) or streamed (`frames`: ~1 MiB
windows); the gRPC transport (`rpc.ServiceSpec.call`) chooses by size and both forms read the
same way (`receive`, `Assembler`). A `Direct` stream (the bulk path, `bulk`) has its header already
decoded and reads each tensor's bytes straight into its array. Windows arrive in order and end
exactly at the tensors' end; anything else is a `StreamError` naming what was wrong, so a bad
peer gets INVALID_ARGUMENT and nothing half-written is used.

Not thread-safe: one `Assembler` per stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from jaxps.v1 import tensor_pb2
from jaxps_runtime.wire import codec

CHUNK_BYTES = 1 << 20
# Init only: a shard's `TensorSpec.rows` declares how pushes update it, as one little-endian
# int64: its row count when by rows (an embedding table's shard), `UPDATED_WHOLE` when whole.
# A chief that declares sets it on every shard; one that sets it on none declares nothing.
UPDATED_WHOLE = -1

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


class LayoutError(StreamError):
    """A stream whose tensors are not those the receiver expects (names, shapes, dtypes): the
    two ends hold different variables, which no retry changes."""


class HeaderError(StreamError):
    """A stream's header that decodes but describes no tensors the receiver can take, with the
    header for the receiver's checks (who sent it)."""

    def __init__(self, message: str, header: tensor_pb2.FrameHeader) -> None:
        super().__init__(message)
        self.header = header


class TooManyTensorsError(HeaderError):
    """A stream's header names more tensors than the receiver allows (`receive`'s `most`);
    refused before anything is made of them."""


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


def first_duplicate(names: Iterable[str]) -> str | None:
    """The first name that appears a second time, or None; linear in the number of names (a
    peer chooses how many it sends)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


ALIGNMENT = 64


def empty(shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is 64-byte aligned.

    Everything received that goes into a jitted function lands in one of these: XLA's CPU
    client uses an aligned host array in place, while an array numpy allocated itself (16-byte
    aligned) is first copied at a few GB/s, several milliseconds per megabytes-sized tensor.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def aligned(array: np.ndarray) -> bool:
    """Whether XLA can use the array's data in place; an empty array has no data to copy."""
    return array.size == 0 or array.ctypes.data % ALIGNMENT == 0


def byte_view(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array, without copying."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8).data


@dataclass(frozen=True)
class Reply:
    """A Frame-stream reply as a servicer builds it: the header and each tensor's bytes, in
    header order. The transport (`rpc`) frames it packed or streamed."""

    header: tensor_pb2.FrameHeader
    buffers: Sequence[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers)


def frames(
    header: tensor_pb2.FrameHeader,
    buffers: Iterable[memoryview],
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[bytes]:
    """Encoded frames carrying the bytes of `buffers` back to back in windows of `chunk_bytes`
    (a window may span tensors); the header rides on the first frame, which carries the first
    window too. A frame's `offset` is where its window starts in the stream's bytes."""
    first: tensor_pb2.FrameHeader | None = header
    parts: list[memoryview] = []
    size = offset = 0

    def frame() -> bytes:
        nonlocal first
        msg = tensor_pb2.Frame(offset=offset)
        if first is not None:
            msg.header.CopyFrom(first)
            first = None
        return codec.encode_parts(msg, parts)

    for buf in buffers:
        at = 0
        while at < len(buf):
            take = min(chunk_bytes - size, len(buf) - at)
            parts.append(buf[at : at + take])
            at += take
            size += take
            if size == chunk_bytes:
                yield frame()
                offset += size
                parts, size = [], 0
    if size or first is not None:  # the last window, or the header alone
        yield frame()


def pack(header: tensor_pb2.FrameHeader, buffers: Iterable[memoryview]) -> bytes:
    """One frame carrying `header` and every buffer back to back: the packed form of a stream."""
    return codec.encode_parts(tensor_pb2.Frame(header=header), list(buffers))


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


class Direct:
    """A stream whose header is decoded and whose `nbytes` bytes of tensors are read in order
    into given buffers (`readinto` fills the whole view or raises): no frame and no copy."""

    header: tensor_pb2.FrameHeader
    nbytes: int

    def readinto(self, view: memoryview) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Done reading (its reader may reuse what carried it)."""


class Assembler:
    """Puts a stream's windows back into whole tensors, in place into given buffers or into new
    ones (`allocate`, or `empty`); with neither `into` nor `allocate`, a tensor that one frame
    carries whole stays a zero-copy view of the received bytes."""

    def __init__(
        self,
        specs: Sequence[Spec],
        *,
        into: Sequence[np.ndarray | None] | None = None,
        allocate: Callable[[Spec], np.ndarray] | None = None,
    ) -> None:
        self.specs = tuple(specs)
        self._allocate = allocate
        self._arrays: list[np.ndarray | None] = list(into) if into else [None] * len(self.specs)
        self._starts = [0] * len(self.specs)
        at = 0
        for i, spec in enumerate(self.specs):
            self._starts[i] = at
            at += spec.nbytes
        self.total = at
        self.bytes = 0  # received so far: where the next frame's window must start
        self._next = 0  # the first tensor not complete yet

    def add(self, decoded: codec.Decoded) -> range:
        """Takes one frame; returns the indices of the tensors it completed."""
        frame, data = decoded
        if frame.offset != self.bytes:
            raise StreamError(
                f"frame at byte {frame.offset}, expected byte {self.bytes} (frames arrive in order)"
            )
        end = self.bytes + len(data)
        if end > self.total:
            raise StreamError(
                f"frames carry {end} bytes; the header's {len(self.specs)} tensors hold "
                f"{self.total}"
            )
        first = self._next
        while self._next < len(self.specs):
            i = self._next
            spec, start = self.specs[i], self._starts[i]
            lo, hi = max(start, self.bytes), min(start + spec.nbytes, end)
            if hi > lo or spec.nbytes == 0:
                self._copy(i, data[lo - self.bytes : hi - self.bytes], at=lo - start)
            if start + spec.nbytes > end:
                break
            self._next += 1
        self.bytes = end
        return range(first, self._next)

    def read_from(self, source: Direct) -> Iterator[range]:
        """Reads every tensor of a `Direct` stream into its array, yielding each one done."""
        if source.nbytes != self.total:
            raise StreamError(
                f"the stream carries {source.nbytes} bytes; the header's {len(self.specs)} "
                f"tensors hold {self.total}"
            )
        for i, spec in enumerate(self.specs):
            out = self._arrays[i]
            if out is None:
                out = self._allocate(spec) if self._allocate else empty(spec.shape, spec.dtype)
                self._arrays[i] = out
            if spec.nbytes:
                source.readinto(out.reshape(-1).view(np.uint8).data)
            self.bytes += spec.nbytes
            self._next = i + 1
            yield range(i, i + 1)

    def _copy(self, index: int, window: memoryview, *, at: int) -> None:
        spec, out = self.specs[index], self._arrays[index]
        if out is None and len(window) == spec.nbytes and self._allocate is None:
            self._arrays[index] = np.frombuffer(window, dtype=spec.dtype).reshape(spec.shape)
            return
        if out is None:
            out = self._allocate(spec) if self._allocate else empty(spec.shape, spec.dtype)
            self._arrays[index] = out
        flat = out.reshape(-1).view(np.uint8)
        flat[at : at + len(window)] = np.frombuffer(window, dtype=np.uint8)

    def array(self, index: int) -> np.ndarray:
        out = self._arrays[index]
        if out is None or index >= self._next:
            raise StreamError(f"tensor {self.specs[index].name!r} is not complete")
        return out

    def missing(self) -> list[str]:
        """Tensors not complete, as "name (got/total bytes)"."""
        return [
            f"{s.name!r} ({min(max(self.bytes - self._starts[i], 0), s.nbytes)}/{s.nbytes} bytes)"
            for i, s in enumerate(self.specs)
            if i >= self._next
        ]


def receive(
    raw_frames: Iterator[bytes] | Direct,
    *,
    into: Sequence[np.ndarray | None] | None = None,
    allocate: Callable[[Spec], np.ndarray] | None = None,
    where: str,
    expect: Sequence[Spec] | None = None,
    up_to: Collection[int] = (),
    most: int | None = None,
) -> tuple[tensor_pb2.FrameHeader, Assembler, Iterator[range]]:
    """Starts reading a stream: its header, the assembler of its tensors (checked against
    `expect` when given; those of `up_to`, indices in it, may have fewer rows: any first
    dimension up to the expected one) and an iterator over the frames that fills it, yielding
    the tensors each frame completed. The caller drains the iterator, then checks
    `missing()`. A header of more than `most` tensors is `TooManyTensorsError`, at the cost
    of counting them; one
    naming a tensor no `Spec` can be (no name, a dtype or shape that means nothing),
    `HeaderError`."""
    if isinstance(raw_frames, Direct):
        header, first = raw_frames.header, None
    else:
        header, first = read_header(raw_frames)
    if most is not None and len(header.tensors) > most:
        raise TooManyTensorsError(
            f"{where}.tensors: {len(header.tensors)} tensors; at most {most} here", header
        )
    try:
        specs = [
            Spec.from_proto(t, where=f"{where}.tensors[{i}]") for i, t in enumerate(header.tensors)
        ]
    except StreamError as err:
        raise HeaderError(str(err), header) from None
    if expect is not None:
        got = [(s.name, s.shape, s.dtype) for s in specs]
        want = [(s.name, s.shape, s.dtype) for s in expect]
        for i in up_to:  # rows up to the expected: the expectation is what came, if it fits
            name, shape, dtype = want[i]
            came = got[i][1] if i < len(got) else shape
            if came[:1] <= shape[:1] and came[1:] == shape[1:]:
                want[i] = (name, came, dtype)
        if got != want:
            raise LayoutError(f"{where}: the stream carries {_names(got)}, expected {_names(want)}")
    assembler = Assembler(specs, into=into, allocate=allocate)

    def fill() -> Iterator[range]:
        if isinstance(raw_frames, Direct):
            yield from assembler.read_from(raw_frames)
            return
        assert first is not None
        yield assembler.add(first)
        for decoded in decode_all(raw_frames):
            yield assembler.add(decoded)

    return header, assembler, fill()


def _names(specs: Sequence[tuple[str, tuple[int, ...], np.dtype[np.generic]]]) -> str:
    return ", ".join(f"{n} {d.name}{list(s)}" for n, s, d in specs) or "no tensors"


def decode_all(raw_frames: Iterator[bytes], *, start: int = 1) -> Iterator[codec.Decoded]:
    """Decodes the remaining frames of a stream, naming the frame number on error."""
    for number, raw in enumerate(raw_frames, start=start):
        try:
            yield codec.decode(raw)
        except codec.CodecError as err:
            raise StreamError(f"frame {number}: {err}") from err
