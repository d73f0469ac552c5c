from jaxps.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("id", "task_incarnation")
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    task_incarnation: int
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., task_incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("id", "task_incarnation", "step", "loss", "done", "metrics", "examples_per_second", "waiting")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    task_incarnation: int
    step: int
    loss: float
    done: bool
    metrics: _containers.ScalarMap[str, float]
    examples_per_second: float
    waiting: str
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., task_incarnation: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., done: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., examples_per_second: _Optional[float] = ..., waiting: _Optional[str] = ...) -> None: ...

class CoordinatorState(_message.Message):
    __slots__ = ("id", "step", "stop", "live_workers")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    step: int
    stop: bool
    live_workers: int
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., step: _Optional[int] = ..., stop: _Optional[bool] = ..., live_workers: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("id", "task_incarnation", "done", "returned", "want", "leaving", "wait_ms", "held")
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    task_incarnation: int
    done: _containers.RepeatedScalarFieldContainer[int]
    returned: _containers.RepeatedCompositeFieldContainer[ReturnedLease]
    want: bool
    leaving: bool
    wait_ms: int
    held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., task_incarnation: _Optional[int] = ..., done: _Optional[_Iterable[int]] = ..., returned: _Optional[_Iterable[_Union[ReturnedLease, _Mapping]]] = ..., want: _Optional[bool] = ..., leaving: _Optional[bool] = ..., wait_ms: _Optional[int] = ..., held: _Optional[_Iterable[int]] = ...) -> None: ...

class ReturnedLease(_message.Message):
    __slots__ = ("lease", "applied")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    lease: int
    applied: int
    def __init__(self, lease: _Optional[int] = ..., applied: _Optional[int] = ...) -> None: ...

class ShardLease(_message.Message):
    __slots__ = ("lease", "epoch", "shard", "first", "end", "start", "skip")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    lease: int
    epoch: int
    shard: int
    first: int
    end: int
    start: int
    skip: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease: _Optional[int] = ..., epoch: _Optional[int] = ..., shard: _Optional[int] = ..., first: _Optional[int] = ..., end: _Optional[int] = ..., start: _Optional[int] = ..., skip: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("id", "lease", "waiting", "over", "epoch", "hold")
    ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    OVER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    id: _tensor_pb2.Identity
    lease: ShardLease
    waiting: str
    over: bool
    epoch: int
    hold: bool
    def __init__(self, id: _Optional[_Union[_tensor_pb2.Identity, _Mapping]] = ..., lease: _Optional[_Union[ShardLease, _Mapping]] = ..., waiting: _Optional[str] = ..., over: _Optional[bool] = ..., epoch: _Optional[int] = ..., hold: _Optional[bool] = ...) -> None: ...
