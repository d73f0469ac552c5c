from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Identity(_message.Message):
    __slots__ = ("job_id", "ps_incarnation", "cluster_epoch", "task")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PS_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ps_incarnation: int
    cluster_epoch: int
    task: str
    def __init__(self, job_id: _Optional[str] = ..., ps_incarnation: _Optional[int] = ..., cluster_epoch: _Optional[int] = ..., task: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "rows", "optimizer", "dynamic", "counts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    rows: bytes
    optimizer: str
    dynamic: str
    counts: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., rows: _Optional[bytes] = ..., optimizer: _Optional[str] = ..., dynamic: _Optional[str] = ..., counts: _Optional[bytes] = ...) -> None: ...

class FrameHeader(_message.Message):
    __slots__ = ("id", "step", "tensors", "push_id", "min_step", "accepted", "reason", "cursor", "then_read", "shard", "lease", "idle")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    THEN_READ_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    id: Identity
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    push_id: str
    min_step: int
    accepted: bool
    reason: str
    cursor: int
    then_read: bool
    shard: str
    lease: int
    idle: bool
    def __init__(self, id: _Optional[_Union[Identity, _Mapping]] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., push_id: _Optional[str] = ..., min_step: _Optional[int] = ..., accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., cursor: _Optional[int] = ..., then_read: _Optional[bool] = ..., shard: _Optional[str] = ..., lease: _Optional[int] = ..., idle: _Optional[bool] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: FrameHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[FrameHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
